"""Objects that disagree with their manifest (missing, truncated, oversized, another
``.metadata``) are corrupt wherever they are read, and a resume falls back from them
as from a flipped bit; a store that fails (403) is not corruption and falls back from
nothing."""

from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch
from cloudckpt_testkit import FaultPlan, FaultProxy
from test_manager import Counter, run

import cloudckpt.dcp as cloud_dcp
from cloudckpt import (
    MANIFEST_NAME,
    AccessDeniedError,
    CheckpointManager,
    CorruptCheckpointError,
    ManagerOptions,
    open_checkpoint,
    open_store,
)
from cloudckpt.names import DCP_INDEX_NAME
from cloudckpt.util.crc import crc32c_hex

SHARD = "model/__0_0.distcp"
BACKENDS = ["local", "s3", "gcs", "azure"]


def damage(store, key: str, how: str) -> None:
    """Make object ``key`` of ``store`` disagree with its manifest."""
    data = store.get(key)
    if how == "missing":
        store.delete([key])
    elif how == "truncated":
        store.put(key, data[: len(data) // 2])
    else:  # oversized: every committed byte still there, and more
        store.put(key, data + b"\0" * 64)


def restore(backend, **kw):
    state, counter = {"w": torch.zeros(8)}, Counter()
    info = CheckpointManager(backend.root, ManagerOptions(every_steps=1),
                             storage_options=backend.options).restore(
        state, per_rank={"data": counter}, **kw)
    return info, state, counter


@pytest.mark.parametrize("how", ["missing", "truncated", "oversized"])
@pytest.mark.parametrize("name", BACKENDS)
def test_restore_falls_back_from_an_object_that_disagrees_with_the_manifest(
        request, name, how, caplog):
    backend = request.getfixturevalue(name)
    run(CheckpointManager(backend.root, ManagerOptions(every_steps=1),
                          storage_options=backend.options), range(0, 3))
    damage(open_store(backend.uri("step-2"), backend.options), SHARD, how)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        info, state, counter = restore(backend)
    assert info.global_step == 1 and counter.n == 1
    assert torch.equal(state["w"], torch.full((8,), 1.0))
    warned = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warned) == 1 and "step-2" in warned[0] and SHARD in warned[0], warned
    # Named, it is not fallen back from: the reason is raised.
    with pytest.raises(CorruptCheckpointError, match=SHARD) as exc:
        restore(backend, uri=backend.uri("step-2"))
    assert SHARD in exc.value.problems


@pytest.mark.parametrize("name", ["local", "s3"])
def test_restore_falls_back_from_another_steps_metadata(request, name, caplog):
    """Step 2's DCP index replaced by step 1's: a valid index of the same size, but not
    the bytes step 2 committed."""
    backend = request.getfixturevalue(name)
    run(CheckpointManager(backend.root, ManagerOptions(every_steps=1),
                          storage_options=backend.options), range(0, 3))
    key = f"model/{DCP_INDEX_NAME}"
    older = open_store(backend.uri("step-1"), backend.options).get(key)
    newest = open_store(backend.uri("step-2"), backend.options)
    assert newest.get(key) != older and len(newest.get(key)) == len(older)
    newest.put(key, older)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        info, state, _ = restore(backend)
    assert info.global_step == 1 and torch.equal(state["w"], torch.full((8,), 1.0))
    assert "step-2 is corrupt" in caplog.text and DCP_INDEX_NAME in caplog.text
    with pytest.raises(CorruptCheckpointError, match=rf"{DCP_INDEX_NAME}.*crc32c"):
        restore(backend, uri=backend.uri("step-2"))


def test_a_refused_read_is_not_corruption(s3, s3_server, caplog):
    """A 403 on the newest checkpoint's shard is the store's failure: it is raised,
    and nothing falls back to an older step behind it."""
    run(CheckpointManager(s3.root, ManagerOptions(every_steps=1), storage_options=s3.options),
        range(0, 3))
    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.set_plan(FaultPlan(permanent_status=403, match=f"step-2/{SHARD}",
                                 methods=("GET",)))
        opts = {**s3.options, "endpoint_url": proxy.endpoint}
        state = {"w": torch.zeros(8)}
        with caplog.at_level(logging.WARNING, logger="cloudckpt"), \
                pytest.raises(AccessDeniedError):
            CheckpointManager(s3.root, ManagerOptions(every_steps=1),
                              storage_options=opts).restore(state)
        assert proxy.faults.get("permanent", 0) >= 1
    assert "falling back" not in caplog.text
    assert not torch.equal(state["w"], torch.full((8,), 1.0))


def save_dcp(backend, name: str, indexed: bool | None = None) -> str:
    uri = backend.uri(name)
    cloud_dcp.save({"w": torch.arange(4096.0), "b": torch.ones(3)}, uri,
                   storage_options=backend.options, indexed=indexed)
    return uri


def load_dcp(uri: str, backend) -> dict:
    target = {"w": torch.zeros(4096), "b": torch.zeros(3)}
    cloud_dcp.load(target, uri, storage_options=backend.options)
    return target


@pytest.mark.parametrize("how", ["missing", "truncated"])
@pytest.mark.parametrize("name", BACKENDS)
def test_a_dcp_load_names_a_missing_or_truncated_shard(request, name, how):
    """``dcp.load`` reads byte ranges (no listing): the object a read finds missing or
    ending early is corrupt, named, where it used to be a storage failure."""
    backend = request.getfixturevalue(name)
    uri = save_dcp(backend, "dcp")
    shard = next(f for f in open_checkpoint(uri, backend.options).files
                 if f.endswith(".distcp"))
    damage(open_store(uri, backend.options), shard, how)
    with pytest.raises(CorruptCheckpointError, match=shard) as exc:
        load_dcp(uri, backend)
    assert list(exc.value.problems) == [shard]


def recommit_metadata(uri: str, backend, change) -> None:
    """Commit ``.metadata`` changed by ``change`` (its manifest entry to match): a
    .metadata its manifest vouches for, saying something else."""
    md = cloud_dcp.CloudStorageReader(uri, storage_options=backend.options).read_metadata()
    change(md)
    recommit(open_store(uri, backend.options), ".metadata", pickle.dumps(md))


def recommit(store, key: str, raw: bytes) -> None:
    """Put ``raw`` at ``key`` and rewrite the manifest to vouch for it."""
    store.put(key, raw)
    doc = json.loads(store.get(MANIFEST_NAME))
    doc["files"][key] = {"size": len(raw), "crc32c": crc32c_hex(raw)}
    store.delete([MANIFEST_NAME])
    store.put(MANIFEST_NAME, json.dumps(doc).encode())


def _elsewhere(md) -> None:
    for info in md.storage_data.values():
        info.relative_path = "elsewhere.distcp"


def _offsets_as_text(md) -> None:
    for info in md.storage_data.values():
        info.offset = str(info.offset)


def _past_the_end(md) -> None:
    for info in md.storage_data.values():
        info.length += 10**6


@pytest.mark.parametrize("change, names", [(_elsewhere, ".metadata"),
                                           (_offsets_as_text, ".distcp"),
                                           (_past_the_end, ".distcp")])
def test_a_metadata_that_is_not_the_checkpoints_is_corrupt(local, change, names):
    uri = save_dcp(local, "dcp", indexed=False)
    recommit_metadata(uri, local, change)
    with pytest.raises(CorruptCheckpointError) as exc:
        load_dcp(uri, local)
    assert [p for p in exc.value.problems if p.endswith(names)], exc.value.problems


def _locations(doc: dict, change) -> None:
    for item in [*doc["tensors"], *doc["bytes"]]:
        if item["location"] is not None:
            change(item["location"])


@pytest.mark.parametrize("change, names", [
    (lambda loc: loc.__setitem__(0, "elsewhere.distcp"), DCP_INDEX_NAME),
    (lambda loc: loc.__setitem__(1, str(loc[1])), DCP_INDEX_NAME),
    (lambda loc: loc.__setitem__(2, loc[2] + 10**6), ".distcp")],
    ids=["elsewhere", "offsets_as_text", "past_the_end"])
def test_an_index_that_is_not_the_checkpoints_is_corrupt(local, change, names):
    """The indexed format's index, recommitted saying something else: a location in a
    file the checkpoint lacks, an offset that is not a number, a length past the end."""
    uri = save_dcp(local, "dcp", indexed=True)
    store = open_store(uri, local.options)
    doc = json.loads(store.get(DCP_INDEX_NAME))
    _locations(doc, change)
    recommit(store, DCP_INDEX_NAME, json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError) as exc:
        load_dcp(uri, local)
    assert [p for p in exc.value.problems if p.endswith(names)], exc.value.problems


@pytest.mark.parametrize("how", ["missing", "truncated", "oversized"])
@pytest.mark.parametrize("framework", ["verl", "rlinf", "roll"])
def test_the_frameworks_automatic_resumes_skip_it_too(s3, framework, how, caplog):
    """verl's ``resume_mode: auto``, RLinf's ``resume_dir: auto`` and ROLL's latest
    checkpoint pass over a newest step whose objects disagree with its manifest, with a
    WARNING naming the object, instead of failing on it at every automatic restart."""
    from cloudckpt import CheckpointWriter
    from cloudckpt.integrations.rlinf.resume import resolve_resume_dir
    from cloudckpt.integrations.roll.resume import latest_committed
    from cloudckpt.integrations.verl.resume import latest_step

    name, kind, latest = {
        "verl": ("global_step_{}", "verl", lambda: latest_step(s3.root, s3.options)),
        "rlinf": ("global_step_{}", "rlinf",
                  lambda: resolve_resume_dir("auto", s3.root, s3.options)),
        "roll": ("checkpoint-{}", "roll",
                 lambda: latest_committed(open_store(s3.root, s3.options))),
    }[framework]
    for step in (1, 2):
        with CheckpointWriter(s3.uri(name.format(step)), step=step, kind=kind,
                              storage_options=s3.options) as w:
            w.put("weights.bin", bytes(range(256)) * step)
    assert latest().rstrip("/").endswith(name.format(2))
    damage(open_store(s3.uri(name.format(2)), s3.options), "weights.bin", how)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert latest().rstrip("/").endswith(name.format(1))
    assert f"skipping {s3.uri(name.format(2))}" in caplog.text
    assert "weights.bin" in caplog.text
