"""What only the Azure backend does, over Azurite on 127.0.0.1: the service's own
transfer checks, its conditional writes as the probe sees them, abfss:// names,
streamed ranged reads and server-side copies. The shared suites (storage, commits,
DCP, manager, slots, torture) run over Azurite through the ``backend`` fixture."""

from __future__ import annotations

import os
from typing import Any

import pytest

from cloudckpt import CheckpointWriter, ConfigError, StorageError, open_checkpoint
from cloudckpt.movement.checkpoint_copy import copy_checkpoint
from cloudckpt.storage import conditional, open_store
from cloudckpt.storage.backends.azure import backend as azure_mod

PART = 256 * 1024


def parts(backend: Any) -> dict[str, Any]:
    return {**backend.options, "part_size": PART}


@pytest.mark.parametrize("check", ["crc64", "md5"])
@pytest.mark.parametrize("size", [1000, 3 * PART + 5])  # one Put Blob; staged blocks
def test_the_service_checks_every_request_body(azure, monkeypatch, check, size):
    """A digest that does not match the body is refused by Azurite: the header is
    sent and checked, for single puts and for each staged block."""
    store = open_store(azure.uri("t"), {**parts(azure), "transfer_checksum": check})
    data = os.urandom(size)
    store.put("good.bin", data)
    assert store.get("good.bin") == data
    wrong = {"crc64": {"transactional_content_crc64": b"\0" * 8},
             "md5": {"transactional_content_md5": b"\0" * 16}}[check]
    monkeypatch.setattr(azure_mod.AzureBackend, "checked", lambda self, data: wrong)
    with pytest.raises(StorageError, match="bad.bin"):
        with store.open_write("bad.bin") as out:
            out.write(data)
    assert not store.exists("bad.bin")


def test_crc64_is_azures(azure):
    # The CRC-64/NVME check value (the polynomial Azure Storage uses).
    assert azure_mod.crc64_of(b"123456789") == 0xAE8B14860A799888
    view = memoryview(bytearray(os.urandom(3 * azure_mod._CRC_SLICE + 7)))
    assert azure_mod.crc64_of(view) == azure_mod.crc64_of(bytes(view))


def test_an_unknown_transfer_checksum_is_refused(azure):
    with pytest.raises(ConfigError, match="transfer_checksum='sha1'.*'crc64', 'md5', 'none'"):
        open_store(azure.uri("t"), {**azure.options, "transfer_checksum": "sha1"})


def test_the_probe_finds_native_conditional_writes(azure):
    store = open_store(azure.uri("probe"), azure.options)
    path = store.path(conditional.probe_key())
    assert conditional.probe(store.backend, path, lambda: store.backend.delete([path], ""),
                             "azurite") == conditional.NATIVE
    assert store.backend.find(store.root) == {}  # the probe object went


def test_abfss_names_the_container_before_the_account(azure, azurite_server):
    container, _, prefix = azure.root.removeprefix("az://").partition("/")
    uri = f"abfss://{container}@devstoreaccount1.dfs.core.windows.net/{prefix}/ck"
    writer = CheckpointWriter(uri, step=1, storage_options=azure.options)
    writer.put("a.bin", b"abc")
    writer.commit()
    assert open_checkpoint(azure.uri("ck"), azure.options).read("a.bin") == b"abc"


def test_a_ranged_read_streams_pieces_of_at_most_the_chunk(azure):
    store = open_store(azure.uri("r"), azure.options)
    data = os.urandom(5 * (1 << 20) + 3)
    store.put("big.bin", data)
    got: list[tuple[int, int]] = []
    out = bytearray(len(data))

    def sink(offset: int, piece: bytes) -> None:
        got.append((offset, len(piece)))
        out[offset - 1000:offset - 1000 + len(piece)] = piece

    store.read_range_to("big.bin", 1000, len(data), sink, chunk=300_000)
    assert bytes(out[:len(data) - 1000]) == data[1000:]
    assert max(n for _, n in got) <= 300_000
    with pytest.raises(EOFError):
        store.read_range_to("big.bin", 0, len(data) + 10, lambda o, d: None)


def test_a_copy_within_one_account_sends_no_bytes(azure, monkeypatch):
    """cp within Azure: Copy Blob on the service, then a read-back (Azure keeps no
    CRC32C to vouch for the copy); nothing is uploaded from this process."""
    src_uri = azure.uri("src")
    w = CheckpointWriter(src_uri, step=3, storage_options=parts(azure))
    objs = {"small.bin": os.urandom(1000), "big.bin": os.urandom(3 * PART + 1)}
    for name, data in objs.items():
        w.put(name, data)
    w.commit()
    uploads: list[str] = []
    copies: list[str] = []
    real_put, real_copy = azure_mod.AzureBackend.put, azure_mod.AzureBackend.copy

    def counting_put(self: Any, path: str, data: Any) -> str:
        uploads.append(path)
        return real_put(self, path, data)

    def counting_copy(self: Any, src_path: str, path: str, *a: Any) -> Any:
        copies.append(path.rsplit("/", 1)[-1])
        return real_copy(self, src_path, path, *a)

    monkeypatch.setattr(azure_mod.AzureBackend, "put", counting_put)
    monkeypatch.setattr(azure_mod.AzureBackend, "copy", counting_copy)
    monkeypatch.setattr(azure_mod._BlockWriter, "_upload",
                        lambda *a: pytest.fail("a block was staged from this process"))
    out = copy_checkpoint(src_uri, azure.uri("dst"), src_options=azure.options,
                          dst_options=azure.options)
    assert sorted(copies) == sorted(objs)
    assert uploads == []  # the manifest goes create-only, not through put
    for name, data in objs.items():
        assert out.read(name) == data


def test_a_missing_container_and_a_wrong_key_are_named(azure, azurite_server):
    from cloudckpt import AccessDeniedError, BucketNotFoundError

    store = open_store("az://no-such-container/run", azure.options)
    with pytest.raises(BucketNotFoundError, match="no-such-container"):
        store.put("a.bin", b"a")
    with pytest.raises(FileNotFoundError):
        store.get("a.bin")
    with pytest.raises(BucketNotFoundError, match="az://no-such-container"):
        store.check_bucket()  # what a read that found nothing asks next
    wrong = azurite_server.connection_string.replace(azurite_server.KEY, "A" * 88)
    denied = open_store(azure.uri("t"), {**azure.options, "connection_string": wrong})
    with pytest.raises(AccessDeniedError):
        denied.put("a.bin", b"a")
