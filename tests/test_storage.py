"""The Store contract, run against every backend (S3 and GCS over real HTTP)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cloudckpt import CommitConflictError, ConfigError, StorageError, open_store
from cloudckpt.util.crc import crc32c_hex


def test_put_get_range_info_list_delete(backend):
    store = open_store(backend.root, backend.options)
    data = os.urandom(100_000)
    info = store.put("a/b/obj.bin", data)
    assert info.size == len(data) and info.crc32c == crc32c_hex(data)
    assert store.get("a/b/obj.bin") == data
    assert store.get_range("a/b/obj.bin", 10, 1010) == data[10:1010]
    assert store.exists("a/b/obj.bin") and not store.exists("a/b/missing")
    assert store.size("a/b/obj.bin") == len(data)
    store.put("a/c.bin", b"c")
    store.put("z.bin", b"z")
    assert [o.key for o in store.list()] == ["a/b/obj.bin", "a/c.bin", "z.bin"]
    assert [o.key for o in store.list("a")] == ["a/b/obj.bin", "a/c.bin"]
    assert store.list_prefixes() == ["a"]
    assert store.list_prefixes("a") == ["a/b"]
    with pytest.raises(FileNotFoundError):
        store.get("nope")
    assert store.delete_prefix("a") == 2
    assert [o.key for o in store.list()] == ["z.bin"]
    store.delete(["z.bin", "never-existed"])
    assert store.list() == []


def test_listings_tell_when_each_object_was_written(backend):
    # gc and blob sweeps judge a save's age by these times: a missing one reads as
    # "written at the epoch", and a live save would look abandoned
    store = open_store(backend.root, backend.options)
    before = time.time()
    store.put("t/one.bin", b"1")
    with store.open_write("t/two.bin") as f:
        f.write(b"2")
    after = time.time()
    listed = store.list("t")
    assert [o.key for o in listed] == ["t/one.bin", "t/two.bin"]
    for o in listed:
        assert o.mtime is not None and before - 2 <= o.mtime <= after + 2, (o.key, o.mtime)


def test_batches_keep_order_and_content(backend):
    store = open_store(backend.root, backend.options)
    items = {f"obj-{i:02d}": os.urandom(1000 + i) for i in range(24)}
    infos = store.put_many(items)
    assert {k: i.crc32c for k, i in infos.items()} == {k: crc32c_hex(v) for k, v in items.items()}
    keys = sorted(items, reverse=True)
    assert store.get_many(keys) == {k: items[k] for k in keys}
    ranges = [(k, 5, 50) for k in keys]
    assert store.get_ranges(ranges) == [items[k][5:50] for k in keys]


def test_iter_ranges_streams_in_order_within_a_window(backend):
    store = open_store(backend.root, backend.options)
    items = {f"obj-{i:02d}": os.urandom(2000 + i) for i in range(12)}
    store.put_many(items)
    ranges = [(k, 7, 1500) for k in sorted(items)]
    in_flight, peak, lock = [0], [0], threading.Lock()
    real = store.get_range

    def tracked(key: str, start: int, end: int) -> bytes:
        with lock:
            in_flight[0] += end - start
            peak[0] = max(peak[0], in_flight[0])
        try:
            return real(key, start, end)
        finally:
            with lock:
                in_flight[0] -= end - start

    store.get_range = tracked  # type: ignore[method-assign]
    assert list(store.iter_ranges(ranges, max_bytes=3000)) == [items[k][7:1500]
                                                              for k in sorted(items)]
    assert 0 < peak[0] <= 3000  # two ranges at most
    it = store.iter_ranges(ranges)
    assert next(it) == items["obj-00"][7:1500]
    it.close()  # stopping early leaves nothing running
    assert in_flight[0] == 0
    with pytest.raises(FileNotFoundError):
        list(store.iter_ranges([("obj-00", 0, 10), ("missing", 0, 10)]))


def test_streamed_write_is_atomic(backend):
    store = open_store(backend.root, {**backend.options, "part_size": 5 * 1024 * 1024})
    chunks = [os.urandom(1024 * 1024) for _ in range(11)]  # 11 MiB: 3 parts on S3
    with store.open_write("big.bin") as w:
        for c in chunks:
            w.write(c)
    assert w.info is not None and w.info.crc32c == crc32c_hex(b"".join(chunks))
    assert store.get("big.bin") == b"".join(chunks)

    with pytest.raises(RuntimeError):
        with store.open_write("aborted.bin") as w:
            w.write(chunks[0])
            w.write(chunks[1])
            raise RuntimeError("boom")
    assert not store.exists("aborted.bin")


def test_create_only_conflict(backend):
    store = open_store(backend.root, backend.options)
    store.put_if_absent("manifest.json", b"first")
    with pytest.raises(CommitConflictError, match="exists already"):
        store.put_if_absent("manifest.json", b"second")
    assert store.get("manifest.json") == b"first"


def test_compare_and_swap(backend):
    store = open_store(backend.root, backend.options)
    store.put("pointer", b"gen-1")
    data, v1 = store.get_with_version("pointer")
    assert data == b"gen-1"
    v2 = store.put_if_match("pointer", b"gen-2", v1).version
    assert v2 and v2 != v1
    with pytest.raises(CommitConflictError, match="no longer"):
        store.put_if_match("pointer", b"gen-3", v1)  # stale token
    assert store.get_with_version("pointer") == (b"gen-2", v2)
    store.put_if_match("pointer", b"gen-3", v2)
    assert store.get("pointer") == b"gen-3"


@pytest.mark.parametrize("key", ["../x", "/etc/x", "a//b", "s3://other/x", "a/./b", ""])
def test_keys_cannot_escape_the_root(memory, key):
    store = open_store(memory.root)
    with pytest.raises(ConfigError):
        store.put(key, b"x")


def test_missing_bucket_is_a_storage_error(s3):
    store = open_store("s3://no-such-bucket/prefix", s3.options)
    with pytest.raises(StorageError, match="bucket does not exist"):
        store.put("a", b"1")


def test_bad_options_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown storage options"):
        open_store(str(tmp_path), {"endpoint_url": "http://x"})
    with pytest.raises(ConfigError):
        open_store("s3://")
    with pytest.raises(ConfigError):
        open_store(str(tmp_path), {"retry": {"bogus": 1}})


def test_environment_endpoint_is_used(s3, monkeypatch):
    """AWS_ENDPOINT_URL and AWS_* keys are enough, as with any boto tool."""
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    store = open_store(s3.root, {"retry": s3.options["retry"]})
    store.put("env.bin", b"via environment")
    assert open_store(s3.root, s3.options).get("env.bin") == b"via environment"


def test_s3_uploads_are_checksummed_and_not_hashed_again_into_the_signature(s3, s3_server):
    """Over plain HTTP, every upload carries a checksum moto verifies, and no SHA-256 of
    its body (botocore's HTTPS behaviour); signing the body is the user's to ask for, and
    stays on where checksums are turned off."""
    from cloudckpt_testkit import FaultProxy

    def uploads(config: dict | None, data: bytes) -> list:
        with FaultProxy(s3_server.endpoint) as proxy:
            opts = {**s3.options, "endpoint_url": proxy.endpoint}
            if config is not None:
                opts["config_kwargs"] = config
            store = open_store(s3.uri("unsigned"), opts)
            store.put("put.bin", data)
            store.put_if_absent("created.bin", data)
            with store.open_write("streamed.bin") as w:
                w.write(data)
            for key in ("put.bin", "created.bin", "streamed.bin"):
                assert store.get(key) == data
            return [r.headers for r in proxy.request_log if r.method == "PUT"]

    data = os.urandom(70_000)
    default = uploads(None, data)
    assert len(default) >= 3  # and the conditional-write probe's
    for headers in default:
        assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
        assert any(h.startswith("x-amz-checksum-crc32") for h in headers)
    signed = uploads({"s3": {"payload_signing_enabled": True}}, data)
    hashes = [h["x-amz-content-sha256"] for h in signed]
    assert hashes.count(hashlib.sha256(data).hexdigest()) == 3
    assert "UNSIGNED-PAYLOAD" not in hashes
    unchecked = uploads({"request_checksum_calculation": "when_required"}, data)
    assert all(h["x-amz-content-sha256"] != "UNSIGNED-PAYLOAD" for h in unchecked)


def test_stores_pickle(backend):
    import pickle

    store = open_store(backend.root, backend.options)
    store.put_many({"a": b"1", "b": b"2"})  # builds the pool
    clone = pickle.loads(pickle.dumps(store))
    assert clone.get_many(["a", "b"]) == {"a": b"1", "b": b"2"}
    assert clone.child("x").uri == store.uri + "/x"


def test_local_delete_leaves_no_empty_directories(local):
    store = open_store(local.uri("ckpt"), local.options)
    store.put_many({"a/b/c.bin": b"1", "a/d.bin": b"2", "e.bin": b"3"})
    store.delete(["e.bin"])
    store.delete_prefix("")
    parent = open_store(local.root, local.options)
    assert parent.list_prefixes() == []


def test_gcs_stream_composes_parts_in_a_tree(gcs):
    """70 parts: composed 32 at a time, then into the object; parts never listed,
    all gone after."""
    store = open_store(gcs.root, {**gcs.options, "part_size": 256 * 1024})
    data = os.urandom(70 * 256 * 1024 - 1000)
    with store.open_write("big.bin") as w:
        for i in range(0, len(data), 300_000):
            w.write(data[i:i + 300_000])
            assert [o.key for o in store.list()] == []  # parts are hidden
    assert w.info.crc32c == crc32c_hex(data)
    assert store.get("big.bin") == data
    raw = store.fs.find(f"{store.root}/")
    assert [p.rsplit("/", 1)[-1] for p in raw] == ["big.bin"]  # parts and tree deleted


def test_gcs_compose_of_a_wrong_part_fails_the_write(gcs, monkeypatch):
    """A part stored with other bytes than sent (say, twice) must not become an
    object that a manifest could list: the composed CRC32C is checked."""
    from cloudckpt.storage.backends.gcs import backend as gcs_mod

    store = open_store(gcs.root, {**gcs.options, "part_size": 256 * 1024})
    real_finish = gcs_mod._ComposeWriter._finish

    def finish_after_damage(self, tokens, size, crc32c):
        store.fs.pipe_file(tokens[1], b"x" * (256 * 1024))  # a part goes wrong
        return real_finish(self, tokens, size, crc32c)

    monkeypatch.setattr(gcs_mod._ComposeWriter, "_finish", finish_after_damage)
    with pytest.raises(StorageError, match="composed with .* were written"):
        with store.open_write("big.bin") as w:
            w.write(os.urandom(3 * 256 * 1024))
    assert store.fs.find(f"{store.root}/") == []  # neither the object nor its parts


def test_gcs_parts_of_a_crashed_writer_go_with_their_prefix(gcs):
    store = open_store(gcs.root, {**gcs.options, "part_size": 256 * 1024})
    w = store.open_write("step-1/big.bin")
    w.write(os.urandom(4 * 256 * 1024))  # parts uploaded; the writer never closes
    w._raw._shutdown()
    assert store.list() == [] and len(store.fs.find(f"{store.root}/")) >= 2
    store.delete_prefix("step-1")
    assert store.fs.find(f"{store.root}/") == []


def test_gcs_failed_part_fails_the_stream_early(gcs, gcs_server):
    """A part refused for good stops the write at the next part, not at commit after
    the whole stream was read and sent."""
    from cloudckpt_testkit import FaultPlan, FaultProxy

    with FaultProxy(gcs_server.endpoint) as proxy:
        opts = {**gcs.options, "endpoint_url": proxy.endpoint, "part_size": 256 * 1024}
        store = open_store(gcs.root, opts)
        proxy.set_plan(FaultPlan(permanent_status=403, match="uploadType=multipart"))
        sent = 0
        with pytest.raises(StorageError, match="403|denied"):
            with store.open_write("big.bin") as w:
                for _ in range(40):
                    w.write(os.urandom(256 * 1024))
                    sent += 1
        assert sent < 40, "the stream ran to its end before the failure surfaced"
    assert open_store(gcs.root, gcs.options).list(internal=True) == []


def test_gcs_abort_removes_parts_and_compose_tree(gcs, monkeypatch):
    from cloudckpt.storage.backends.gcs import backend as gcs_mod

    store = open_store(gcs.root, {**gcs.options, "part_size": 256 * 1024})
    real = gcs_mod.GCSBackend._compose

    def compose(self, path, sources):
        if not path.endswith(".cloudckpt-part"):
            raise ValueError("the final compose fails")
        return real(self, path, sources)

    monkeypatch.setattr(gcs_mod.GCSBackend, "_compose", compose)
    with pytest.raises(StorageError, match="final compose fails"):
        with store.open_write("big.bin") as w:
            w.write(os.urandom(40 * 256 * 1024))  # 40 parts: a tree of two intermediates
    assert store.fs.find(f"{store.root}/") == []


def test_gcs_part_limit_is_checked_before_sending(gcs, monkeypatch):
    from cloudckpt.storage.backends.gcs import backend as gcs_mod

    monkeypatch.setattr(gcs_mod._ComposeWriter, "MAX_PARTS", 3)
    store = open_store(gcs.root, {**gcs.options, "part_size": 256 * 1024})
    with pytest.raises(StorageError, match="more than 3 parts"):
        with store.open_write("big.bin") as w:
            w.write(os.urandom(5 * 256 * 1024))
    assert store.fs.find(f"{store.root}/") == []


# ------------------------------------------------------------ the backend contract


def test_a_backend_of_another_distribution_is_found_by_its_entry_point():
    """count:// is the test kit's: declared as an entry point (group cloudckpt.backends),
    never registered by importing its module."""
    from cloudckpt.storage import registry

    assert "count" not in registry._BACKENDS
    assert registry._declared()["count"] == "cloudckpt_testkit.counting:CountingBackend"
    store = open_store("count://entry-point-test/run")
    assert type(store.backend).__name__ == "CountingBackend"
    assert store.uri == "count://entry-point-test/run"
    store.put("a.bin", b"a")
    assert store.get("a.bin") == b"a"


class _Throttled(Exception):
    """An SDK's own errors, which only its backend can classify."""


class _Missing(Exception):
    pass


class _Refused(Exception):
    pass


def _flaky_backend():
    from cloudckpt.storage.backends.memory import MemoryBackend
    from cloudckpt.storage.retry import Classified, Failure

    class FlakyBackend(MemoryBackend):
        protocols = ("flaky",)
        throttles = 2

        def put_checked(self, path, data, crc32c):
            if self.throttles:
                self.throttles -= 1
                raise _Throttled("slow down")
            if path.endswith("denied"):
                raise _Refused("no")
            return super().put_checked(path, data, crc32c)

        def get(self, path, start=None, end=None):
            if path.endswith("gone"):
                raise _Missing(path)
            return super().get(path, start, end)

        def classify(self, exc):
            kinds = {_Throttled: Failure.TRANSIENT, _Missing: Failure.NOT_FOUND,
                     _Refused: Failure.DENIED}
            kind = kinds.get(type(exc))
            return None if kind is None else Classified(kind)

    return FlakyBackend


def test_the_backend_classifies_its_own_failures():
    """The retry policy asks the backend what its exceptions are: a backend's
    TRANSIENT is retried, NOT_FOUND is a FileNotFoundError, DENIED an access error."""
    from cloudckpt import AccessDeniedError, RetryPolicy
    from cloudckpt.storage import Store

    fast = RetryPolicy(max_attempts=5, initial_backoff=0.0, max_backoff=0.0)
    store = Store("flaky-test/run", _flaky_backend(), retry=fast)
    assert store.uri == "flaky://flaky-test/run"
    store.put("a.bin", b"a")  # two throttled attempts, then through
    assert store.backend.throttles == 0 and store.get("a.bin") == b"a"
    with pytest.raises(FileNotFoundError):
        store.get("gone")
    with pytest.raises(AccessDeniedError, match="access was denied"):
        store.put("denied", b"x")


def test_every_builtin_backends_failures_are_judged_without_its_client_library():
    """A failure whose backend is not named (``is_transient(exc)``) is judged by every
    built-in backend's ``errors.classify``, Azure's included, and the registry loads
    those rules without s3fs, gcsfs, adlfs or the Azure SDK."""
    code = textwrap.dedent("""
        import sys
        import cloudckpt.storage as s
        from cloudckpt.storage import registry
        assert all(b.errors for b in registry.BUILTIN if b.schemes[0] in ("s3", "gs", "az"))
        heavy = {"s3fs", "botocore", "gcsfs", "adlfs", "azure.core", "azure.storage.blob"}
        print(sorted(heavy & set(sys.modules)))

        class ServiceResponseError(Exception):
            pass
        ServiceResponseError.__module__ = "azure.core.exceptions"
        class HttpResponseError(Exception):
            status_code, error_code = 503, "ServerBusy"
        HttpResponseError.__module__ = "azure.core.exceptions"
        print(s.is_transient(ServiceResponseError("reset")),
              s.is_transient(HttpResponseError("busy")))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True True"]


def test_stores_opened_one_after_another_reuse_the_io_threads(memory):
    """Every save and load opens its stores afresh: their batches run on threads
    started once per process, not per store, and a forked child starts its own."""
    def threads_of(store) -> set[int]:
        # Every task waits for all the others, so a batch occupies every thread of its
        # pool at once, however the pool grew before (it starts threads lazily).
        together = threading.Barrier(store.max_concurrency)

        def ident(_: int) -> int:
            together.wait(timeout=120)
            return threading.get_ident()
        return set(store.map(ident, range(store.max_concurrency)))

    first = threads_of(open_store("memory://pool/a"))
    later = threads_of(open_store("memory://pool/b", {"max_concurrency": 16}))
    assert len(first) == 16 and later == first
    pid = os.fork()
    if pid == 0:  # the child: its batches run (on new threads) instead of waiting forever
        os._exit(0 if len(threads_of(open_store("memory://pool/c"))) > 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
