"""Security trials: what a hostile checkpoint, a hostile local layout or a failing
credential can do, tried many ways and counted honestly.

- object names in manifests, writers and store keys never lead out of a checkpoint;
- symbolic links in a local store never lead reads, listings, writes or deletes out of it;
- oversized and malformed manifests end in a ManifestError naming the file, in bounded
  memory, whether or not the store reports sizes;
- pickled code planted wherever a checkpoint carries bytes never runs on load;
- credentials never show in logs, messages, tracebacks, CLI output or stored bytes.

Each attack that is not refused as it should be is one failure; a test records its
trials (attack variants), faults (attacks) and failures, then asserts none got through.
Each test fails when the protection it covers is taken out of the library.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import logging
import os
import pickle
import random
import shlex
import stat
import struct
import subprocess
import sys
import traceback
import tracemalloc
import uuid
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from cloudckpt_testkit import FaultPlan, FaultProxy
from knobs import scale
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from cloudckpt import (
    MANIFEST_NAME,
    CheckpointManager,
    CheckpointWriter,
    ManagerOptions,
    RetryPolicy,
    StepInfo,
    cli,
    hf,
    list_checkpoints,
    open_checkpoint,
    open_store,
)
from cloudckpt import dcp as cdcp
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.core.listing import latest_checkpoint
from cloudckpt.core.manifest import FileEntry, Manifest, read_manifest_bytes
from cloudckpt.dcp.metadata import pack_item_crcs
from cloudckpt.errors import (
    CloudCkptError,
    ConfigError,
    CorruptCheckpointError,
    ManifestError,
    StorageError,
)
from cloudckpt.hf.convert import dcp_to_pt
from cloudckpt.integrations import areal, rlinf, roll
from cloudckpt.movement.checkpoint_copy import copy_checkpoint
from cloudckpt.runtime import state as state_module
from cloudckpt.runtime.state import loads_state
from cloudckpt.storage import Store
from cloudckpt.storage.backends.file import FileBackend
from cloudckpt.training import snapshot as training
from cloudckpt.util.crc import crc32c_hex

AREA = "security"
SECRET_BYTES = b"TOP SECRET: the outside world\n"
#: Reading a hostile manifest may cost this much memory at most (each is >= 64 MiB).
MEMORY_BOUND = 16 * 1024 * 1024


# ------------------------------------------------------------------- bookkeeping


class Tally:
    """Counts attacks and the ones that got through (with what happened)."""

    def __init__(self) -> None:
        self.trials = 0
        self.attacks = 0
        self.through: list[str] = []

    def expect(self, what: str, fn: Callable[[], Any], *errors: type[BaseException],
               check: Callable[[BaseException], bool] | None = None) -> BaseException | None:
        """One attack: ``fn`` must raise one of ``errors`` (satisfying ``check``)."""
        self.attacks += 1
        try:
            fn()
        except errors as exc:
            if check is not None and not check(exc):
                self.through.append(f"{what}: unclear {type(exc).__name__}: {exc}"[:400])
            return exc
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - counted
            self.through.append(f"{what}: wrong error {type(exc).__name__}: {exc}"[:400])
            return exc
        self.through.append(f"{what}: no error")
        return None

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        """One attack whose outcome is judged by ``ok``."""
        self.attacks += 1
        if not ok:
            self.through.append(f"{what}: {detail}"[:400])

    def report(self, record: Callable[..., Any], case: str) -> None:
        record(AREA, case, trials=self.trials, faults=self.attacks,
               failures=len(self.through))
        assert not self.through, f"{len(self.through)} attacks got through:\n" + "\n".join(
            self.through)


def _cli(*args: str) -> tuple[int, str]:
    """``cloudckpt ARGS`` in this process: exit code, and stdout + stderr."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = cli.main(list(args))
        except Exception:  # noqa: BLE001 - a crash is an outcome to judge, like an exit code
            traceback.print_exc()
            code = -1
    return code, out.getvalue()


def _write_one(target: str | Store, options: Mapping[str, Any] | None,
               name: str = "x.bin") -> None:
    with CheckpointWriter(target, step=1, storage_options=options) as w:
        w.put(name, b"x")


def copy_to(src: str, dst: str, options: Mapping[str, Any]) -> Any:
    return copy_checkpoint(src, dst, src_options=options, dst_options=options)


def _tree(root: Path, skip: Iterable[Path] = ()) -> dict[str, tuple[Any, ...]]:
    """Everything below ``root`` (links not followed): type, size, mtime, link, CRC32C."""
    skipped = {str(p) for p in skip}
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if os.path.join(dirpath, d) not in skipped]
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            if path in skipped:
                continue
            st = os.lstat(path)
            link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
            crc = None
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    crc = crc32c_hex(f.read())
            if stat.S_ISDIR(st.st_mode):  # a directory's size and mtime follow its entries
                out[os.path.relpath(path, root)] = (stat.S_IFDIR, None, None, None, None)
                continue
            out[os.path.relpath(path, root)] = (stat.S_IFMT(st.st_mode), st.st_size,
                                                st.st_mtime_ns, link, crc)
    return out


def _changes(before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]]) -> str:
    return str(sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)))


def _regular_files(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, files in os.walk(root) for f in files
            if stat.S_ISREG(os.lstat(Path(d) / f).st_mode)]


def _holding(root: Path, data: bytes) -> list[Path]:
    """Regular files below ``root`` whose bytes contain ``data``."""
    return [p for p in _regular_files(root) if data in p.read_bytes()]


def _rewrite_manifest(store: Store, prefix: str,
                      change: Callable[[dict[str, Any]], None]) -> bytes:
    """Rewrite the manifest at ``prefix`` through ``change(doc)``; return its new bytes."""
    key = f"{prefix}/{MANIFEST_NAME}" if prefix else MANIFEST_NAME
    doc = json.loads(store.get(key))
    change(doc)
    raw = json.dumps(doc, indent=1).encode()
    store.put(key, raw)
    return raw


def _plant(store: Store, key: str, data: bytes) -> None:
    """Write ``data`` at ``key`` and fix every manifest above it that lists it (a part's
    manifest listed by its parent included), so only the loader stands in the way."""
    store.put(key, data)
    parts = key.split("/")
    changed_key, changed = key, data
    for depth in range(len(parts) - 1, -1, -1):
        prefix = "/".join(parts[:depth])
        rel = changed_key[len(prefix) + 1:] if prefix else changed_key
        mkey = f"{prefix}/{MANIFEST_NAME}" if prefix else MANIFEST_NAME
        if not store.exists(mkey) or rel not in json.loads(store.get(mkey))["files"]:
            continue

        def entry(doc: dict[str, Any], rel: str = rel, body: bytes = changed) -> None:
            doc["files"][rel] = {"size": len(body), "crc32c": crc32c_hex(body)}

        changed_key, changed = mkey, _rewrite_manifest(store, prefix, entry)


def _peak_memory(fn: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """Run ``fn``; return what it raised and the peak of Python allocations meanwhile."""
    tracemalloc.start()
    try:
        fn()
        error: BaseException | None = None
    except Exception as exc:  # noqa: BLE001 - returned to the caller
        error = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return error, peak


# ============================================================ 1. hostile names


def _hostile_names(absolute: Path) -> list[str]:
    return [
        "../x", "../../../../secret.txt", "a/../../b", "a/b/../../../../secret.txt", "..",
        ".", "", "a/..", "./a", "a/./b", "a//b", "a/", "/x", "//x", str(absolute),
        "/etc/passwd", "\\x", "..\\..\\secret.txt", "a\\..\\..\\x", "C:\\x", "C:x", "c:/x",
        "\\\\server\\share\\x", "x\x00y", "ok\x00/../../x", "s3://other-bucket/x",
        "file:///etc/passwd", MANIFEST_NAME, "a\nb", "\x1b]0;owned\x07x.bin", "\ud800.bin",
    ]


@pytest.fixture
def box(tmp_path: Path) -> Path:
    """A sandbox with a secret file; stores go three levels below it, so every
    ``..`` variant tried still lands inside the sandbox, where it is watched."""
    root = tmp_path / "box"
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "secret.txt").write_bytes(SECRET_BYTES)
    return root


def test_manifest_names_never_leave_the_checkpoint(local, box, record) -> None:
    """Hostile names in a manifest (with the right size and CRC32C of the file they aim
    at) are refused by every reader before a byte is read or written."""
    deep = box / "a" / "b" / "c"
    root, dest = deep / "store", deep / "dest"
    store = open_store(str(root), local.options)
    before = _tree(box, skip=[root, dest])
    t = Tally()
    target = {"size": len(SECRET_BYTES), "crc32c": crc32c_hex(SECRET_BYTES)}
    for i, name in enumerate(_hostile_names(box / "secret.txt")):
        t.trials += 1
        prefix = f"checkpoint-{i}"
        uri = str(root / prefix)
        with CheckpointWriter(uri, step=i, storage_options=local.options) as w:
            w.put("ok.bin", b"fine")

        def add(doc: dict[str, Any], name: str = name) -> None:
            doc["files"][name] = target

        _rewrite_manifest(store, prefix, add)

        def named(exc: BaseException) -> bool:
            return MANIFEST_NAME in str(exc) and "hostile" in str(exc)

        t.expect(f"open {name!r}", partial(open_checkpoint, uri, local.options), ManifestError,
                 check=named)
        t.expect(f"copy {name!r}", partial(copy_to, uri, str(dest / f"cp-{i}"), local.options),
                 ManifestError)
        t.expect(f"hf.download {name!r}", partial(hf.download, uri, dest / f"hf-{i}",
                                                  local.options), ManifestError)
        t.expect(f"ROLL download {name!r}", partial(roll.download_checkpoint, uri,
                                                    dest / f"roll-{i}", local.options),
                 ManifestError)
        code, out = _cli("verify", "--deep", uri)
        t.check(f"cli verify {name!r}", code == cli.EXIT_CORRUPT, f"exit {code}: {out}")
        code, out = _cli("download", uri, str(dest / f"cli-{i}"))
        t.check(f"cli download {name!r}", code == cli.EXIT_CORRUPT, f"exit {code}: {out}")
    infos = list_checkpoints(str(root), local.options, include_uncommitted=True)
    t.check("listing shows none as committed", not any(c.committed for c in infos),
            str([c.name for c in infos if c.committed]))
    after = _tree(box, skip=[root, dest])
    t.check("nothing outside the store changed", after == before, _changes(before, after))
    t.check("nothing was downloaded", not _regular_files(dest) if dest.exists() else True,
            str(_regular_files(dest)) if dest.exists() else "")
    t.report(record, "manifest names leaving the checkpoint")


def test_writers_refuse_hostile_object_names(local, box, record) -> None:
    """What a writer is asked to name an object is checked before anything is written."""
    root = box / "a" / "b" / "c" / "store"
    store = open_store(str(root), local.options)
    before = _tree(box, skip=[root])
    t = Tally()
    for i, name in enumerate(_hostile_names(box / "secret.txt")):
        t.trials += 1
        w = CheckpointWriter(store.child(f"w-{i}"), step=i)
        t.expect(f"put {name!r}", partial(w.put, name, SECRET_BYTES), ManifestError)
        t.expect(f"put_many {name!r}", partial(w.put_many, {name: SECRET_BYTES}), ManifestError)
        t.expect(f"open {name!r}", partial(w.open, name), ManifestError)
        t.expect(f"add_existing {name!r}", partial(w.add_existing, name, 1, "00000000"),
                 ManifestError)
    after = _tree(box, skip=[root])
    t.check("nothing outside the store changed", after == before, _changes(before, after))
    t.check("no object was written", not _holding(root, SECRET_BYTES) if root.exists() else True)
    t.report(record, "writer object names")


_BAD_KEYS = ["..", "../x", "../../secret.txt", "a/../..", "a/../../x", "a/..", "./a", "a/./b",
             "a//b", "/x", "//x", "\\..\\x", "a\\..\\..\\x", "x\x00", "x\x00/../../y",
             "s3://bucket/x", "file:///etc/passwd", ""]
#: Prefixes that stay bad once their slashes are stripped (listings strip them).
_BAD_PREFIXES = ["..", "../x", "../../secret.txt", "a/../..", "a/..", "./a", "a/./b", "a//b",
                 "\\..\\x", "x\x00", "s3://bucket/x"]


def _store_attacks(t: Tally, store: Store, absolute: str) -> None:
    for key in [*_BAD_KEYS, absolute]:
        t.trials += 1
        for op, fn in [
            ("put", partial(store.put, key, SECRET_BYTES)),
            ("get", partial(store.get, key)),
            ("get_range", partial(store.get_range, key, 0, 4)),
            ("get_with_version", partial(store.get_with_version, key)),
            ("info", partial(store.info, key)),
            ("delete", partial(store.delete, [key])),
            ("open_write", partial(store.open_write, key)),
            ("put_if_absent", partial(store.put_if_absent, key, SECRET_BYTES)),
            ("put_if_match", partial(store.put_if_match, key, SECRET_BYTES, "v1")),
        ]:
            t.expect(f"{op} {key!r}", fn, ConfigError)
    for prefix in _BAD_PREFIXES:
        t.trials += 1
        for op, fn in [
            ("child", partial(store.child, prefix)),
            ("list", partial(store.list, prefix)),
            ("list_prefixes", partial(store.list_prefixes, prefix)),
            ("delete_prefix", partial(store.delete_prefix, prefix)),
        ]:
            t.expect(f"{op} {prefix!r}", fn, ConfigError)


def test_store_keys_never_leave_the_root(local, memory, box, record) -> None:
    """Keys with ``..``, absolute paths, schemes, backslashes or NULs are refused by the
    local and memory stores, and nothing outside their roots changes."""
    root = box / "a" / "b" / "c" / "store"
    fstore = open_store(str(root), local.options)
    fstore.put("inside/x.bin", b"inside")
    before = _tree(box, skip=[root])
    mem_fs = fsspec.filesystem("memory")
    mstore = open_store(memory.root)
    mstore.put("inside/x.bin", b"inside")
    mroot = mstore.root
    others = {k: bytes(v.getbuffer()) for k, v in mem_fs.store.items()
              if not k.startswith(mroot + "/")}
    t = Tally()
    _store_attacks(t, fstore, str(box / "secret.txt"))
    _store_attacks(t, mstore, "/" + mroot.strip("/") + "/../secret")
    after = _tree(box, skip=[root])
    t.check("nothing outside the local store changed", after == before,
            _changes(before, after))
    t.check("the local store holds only its own object",
            [o.key for o in fstore.list()] == ["inside/x.bin"])
    now = {k: bytes(v.getbuffer()) for k, v in mem_fs.store.items()
           if not k.startswith(mroot + "/")}
    t.check("nothing outside the memory store changed", now == others)
    t.check("the memory store holds only its own object",
            [o.key for o in mstore.list()] == ["inside/x.bin"])
    t.report(record, "store keys leaving the root")


# ================================================================= 2. symlinks


def _is_outside_error(exc: BaseException) -> bool:
    return isinstance(exc, StorageError) and isinstance(exc, PermissionError) and isinstance(
        exc, CorruptCheckpointError) and "symbolic link" in str(exc)


def test_symlinks_never_lead_out_of_a_local_store(local, tmp_path, record) -> None:
    """Links inside a local store that point outside it: reads refuse them clearly,
    listings skip them, writes and deletes never touch what they point at. Links that
    stay inside the store keep working."""
    opts = local.options
    box = tmp_path / "box"
    outside = box / "outside"
    (outside / "dir").mkdir(parents=True)
    secret = outside / "secret.bin"
    secret.write_bytes(SECRET_BYTES)
    (outside / "dir" / "f.bin").write_bytes(b"outside file")
    with CheckpointWriter(str(outside / "ckpt"), step=99, storage_options=opts) as w:
        w.put("w.bin", b"outside weights")
    root = box / "store"
    store = open_store(str(root), opts)
    with CheckpointWriter(store.child("ck"), step=1) as w:
        w.put("a.bin", b"inside")
    os.symlink(secret, root / "ck" / "link.bin")
    os.symlink(outside / "dir", root / "ck" / "ldir")
    os.symlink("a.bin", root / "ck" / "inlink.bin")  # stays inside: keeps working
    os.symlink(outside / "ckpt", root / "step-99")  # a whole checkpoint linked in
    # ck2's manifest lists files reached through links, with the outside bytes' CRCs.
    with CheckpointWriter(store.child("ck2"), step=2) as w:
        w.put("a.bin", b"inside")
        w.add_existing("link.bin", len(SECRET_BYTES), crc32c_hex(SECRET_BYTES))
        w.add_existing("ldir/f.bin", len(b"outside file"), crc32c_hex(b"outside file"))
    os.symlink(secret, root / "ck2" / "link.bin")
    os.symlink(outside / "dir", root / "ck2" / "ldir")
    (root / "ck3").mkdir()
    os.symlink(outside / "dir", root / "ck3" / "ldir")
    (root / "ck4").mkdir()  # its manifest is another checkpoint's, outside
    os.symlink(outside / "ckpt" / MANIFEST_NAME, root / "ck4" / MANIFEST_NAME)
    (root / "torn").mkdir()  # uncommitted, for gc
    (root / "torn" / "part.bin").write_bytes(b"partial")
    os.symlink(outside / "dir", root / "torn" / "ldir")
    dest, dest2, dest3 = box / "dest", box / "dest2", box / "dest3"
    for d in (dest, dest2, dest3):
        d.mkdir()
        os.symlink(outside / "dir", d / "ldir")
    before = _tree(outside)
    t = Tally()

    # reads
    t.trials += 1
    for what, fn in [
        ("get a linked file", partial(store.get, "ck/link.bin")),
        ("get_range a linked file", partial(store.get_range, "ck/link.bin", 0, 4)),
        ("get_with_version a linked file", partial(store.get_with_version, "ck/link.bin")),
        ("get_many a linked file", partial(store.get_many, ["ck/link.bin", "ck/a.bin"])),
        ("get through a linked dir", partial(store.get, "ck/ldir/f.bin")),
        ("list a linked dir", partial(store.list, "ck/ldir")),
    ]:
        t.expect(what, fn, StorageError, check=_is_outside_error)
    ck2 = open_checkpoint(store.child("ck2"))
    for what, fn in [
        ("Checkpoint.read a linked file", partial(ck2.read, "link.bin")),
        ("Checkpoint.read through a linked dir", partial(ck2.read, "ldir/f.bin")),
        ("Checkpoint.read_range a linked file", partial(ck2.read_range, "link.bin", 0, 4)),
        ("open a linked-in checkpoint", partial(open_checkpoint, store.child("step-99"))),
        ("open a linked-in manifest", partial(open_checkpoint, store.child("ck4"))),
    ]:
        t.expect(what, fn, StorageError, check=_is_outside_error)
    t.expect("verify --deep", partial(ck2.verify, deep=True), CloudCkptError)
    t.expect("copy out", partial(copy_to, str(root / "ck2"), str(box / "copy"), opts),
             CloudCkptError)
    t.expect("hf.download", partial(hf.download, str(root / "ck2"), box / "hf", opts),
             CloudCkptError)
    code, out = _cli("download", str(root / "ck2"), str(box / "cli-dl"))
    t.check("cli download", code != cli.EXIT_OK, f"exit {code}: {out}")
    t.check("no copy holds the secret", not _holding(box / "copy", SECRET_BYTES)
            and not _holding(box / "hf", SECRET_BYTES) and not _holding(box / "cli-dl",
                                                                        SECRET_BYTES))
    t.check("info hides a linked file", store.info("ck/link.bin") is None)
    t.check("exists hides a file through a linked dir", not store.exists("ck/ldir/f.bin"))
    keys = [o.key for o in store.list()]
    t.check("listing skips what links lead to",
            not any(k.rsplit("/", 1)[-1] == "link.bin" or "/ldir/" in k
                    or k.startswith("step-99/") for k in keys), str(keys))
    t.check("prefixes skip linked dirs", "ldir" not in [p.rsplit("/", 1)[-1] for p in
                                                       store.list_prefixes("ck")])
    t.check("checkpoints skip a linked-in one",
            "step-99" not in [c.name for c in list_checkpoints(store, include_uncommitted=True)])
    latest = latest_checkpoint(store)
    t.check("latest is never the linked-in one", latest is None or latest.step != 99)
    # a link that stays inside works
    t.check("a link inside the store still reads", store.get("ck/inlink.bin") == b"inside")

    # writes
    t.trials += 1
    for what, fn in [
        ("put through a linked dir", partial(store.put, "ck/ldir/new.bin", b"x")),
        ("put_if_absent through a linked dir",
         partial(store.put_if_absent, "ck/ldir/new.bin", b"x")),
        ("open_write through a linked dir", partial(store.open_write, "ck/ldir/big.bin")),
        ("writer put through a linked dir",
         partial(_write_one, store.child("ck3"), None, "ldir/x.bin")),
    ]:
        t.expect(what, fn, StorageError, check=_is_outside_error)
    src = f"{local.root}-src"
    with CheckpointWriter(src, step=5, storage_options=opts) as w:
        w.put("ldir/x.bin", b"copied")
        w.put("ldir/f.bin", b"overwrite?")
    t.expect("copy into a store with a linked dir", partial(copy_to, src, str(dest), opts),
             StorageError, check=_is_outside_error)
    t.expect("hf.download into a dir with a linked subdir",
             partial(hf.download, src, dest3, opts), StorageError, check=_is_outside_error)
    code, out = _cli("download", src, str(dest2))
    t.check("cli download into a store with a linked dir",
            code != cli.EXIT_OK and "symbolic link" in out, f"exit {code}: {out}")
    store.put("ck/link.bin", b"replaces the link, not its target")
    t.check("a put onto a link replaces the link", not (root / "ck" / "link.bin").is_symlink())

    # deletes
    t.trials += 1
    t.expect("delete through a linked dir", partial(store.delete, ["ck/ldir/f.bin"]),
             StorageError, check=_is_outside_error)
    t.expect("delete_prefix of a linked dir", partial(store.delete_prefix, "ck/ldir"),
             StorageError, check=_is_outside_error)
    t.expect("rm a linked-in checkpoint", partial(delete_checkpoint, store.child("step-99")),
             StorageError, check=_is_outside_error)
    with contextlib.suppress(CloudCkptError):
        delete_checkpoint(store.child("ck2"))
    code, out = _cli("rm", "--force", str(root / "ck"))
    t.check("cli rm", code in (cli.EXIT_OK, cli.EXIT_CORRUPT), f"exit {code}: {out}")
    code, out = _cli("gc", str(root), "--grace", "0", "--yes")
    t.check("cli gc", code == cli.EXIT_OK, f"exit {code}: {out}")
    after = _tree(outside)
    t.check("nothing outside the store changed", after == before, _changes(before, after))
    t.report(record, "symlinks out of a local store")


# ================================================== 3. oversized and malformed manifests


def _sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


def _big_s3_object(s3: Any, key_uri: str, size: int) -> None:
    """A ``size``-byte object made server-side (multipart copies of one small part), so
    nothing that big ever crosses the test's own memory."""
    import boto3

    bucket, _, key = key_uri.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=s3.options["endpoint_url"],
                          aws_access_key_id=s3.options["key"],
                          aws_secret_access_key=s3.options["secret"], region_name="us-east-1")
    part = 8 * 1024 * 1024
    client.put_object(Bucket=bucket, Key=key + ".part", Body=b"[" * part)
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for n in range(1, -(-size // part) + 1):
        resp = client.upload_part_copy(Bucket=bucket, Key=key, UploadId=upload, PartNumber=n,
                                       CopySource={"Bucket": bucket, "Key": key + ".part"})
        parts.append({"PartNumber": n, "ETag": resp["CopyPartResult"]["ETag"]})
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                     MultipartUpload={"Parts": parts})
    client.delete_object(Bucket=bucket, Key=key + ".part")


def _bounded(t: Tally, what: str, fn: Callable[[], Any], size: int) -> None:
    error, peak = _peak_memory(fn)
    t.check(what, isinstance(error, ManifestError) and MANIFEST_NAME in str(error)
            and peak < MEMORY_BOUND,
            f"{type(error).__name__}: {error} (peak {peak >> 20} MiB for {size >> 20} MiB)")


def test_oversized_manifests_are_refused_unread(local, s3, record) -> None:
    """A manifest far over the limit is refused from its size alone, on local disk (a
    sparse file) and on S3, by every command that opens it."""
    t = Tally()
    size = 256 * 1024 * 1024
    root = Path(local.root)
    _sparse(root / "huge" / MANIFEST_NAME, size)
    uri = str(root / "huge")
    t.trials += 1
    _bounded(t, "open (local)", partial(open_checkpoint, uri, local.options), size)
    _bounded(t, "hf.download (local)", partial(hf.download, uri, root.parent / "dl",
                                               local.options), size)

    def listed() -> None:
        infos = list_checkpoints(str(root), local.options, include_uncommitted=True)
        bad = [i for i in infos if i.name == "huge"]
        if bad and not bad[0].committed and bad[0].error:
            raise ManifestError(bad[0].error)

    _bounded(t, "list (local)", listed, size)

    def info() -> None:
        code, out = _cli("info", uri)
        if code == cli.EXIT_CORRUPT:
            raise ManifestError(out)

    _bounded(t, "cli info (local)", info, size)
    t.trials += 1
    s3_size = 72 * 1024 * 1024
    _big_s3_object(s3, s3.uri("huge", MANIFEST_NAME), s3_size)
    store = open_store(s3.uri("huge"), s3.options)
    store.exists(MANIFEST_NAME)  # the client is set up before memory is watched
    _bounded(t, "open (s3)", partial(open_checkpoint, store), s3_size)
    t.report(record, "oversized manifests")


class _NoSizeBackend(FileBackend):
    """A local backend that, like some fsspec backends, cannot tell an object's size."""

    def head(self, path: str) -> dict[str, Any] | None:
        return None


class _ZeroSizeBackend(FileBackend):
    """A local backend whose listings and heads report every size as 0."""

    def head(self, path: str) -> dict[str, Any] | None:
        raw = super().head(path)
        return None if raw is None else {**raw, "size": 0}


def test_manifest_read_is_bounded_when_the_store_reports_no_size(tmp_path, record) -> None:
    """Without a size to refuse it by, a huge manifest is still never read whole."""
    t = Tally()
    size = 256 * 1024 * 1024
    for cls in (_NoSizeBackend, _ZeroSizeBackend):
        t.trials += 1
        root = tmp_path / cls.__name__
        _sparse(root / "huge" / MANIFEST_NAME, size)
        store = Store(str(root), cls, storage_options={"fsync": False})
        huge = store.child("huge")
        _bounded(t, f"read_manifest_bytes ({cls.__name__})",
                 partial(read_manifest_bytes, huge), size)
        _bounded(t, f"open ({cls.__name__})", partial(open_checkpoint, huge), size)
        # a size from elsewhere (the root index) that understates it is only a hint
        _bounded(t, f"read_manifest_bytes, a size of 100 given ({cls.__name__})",
                 partial(read_manifest_bytes, huge, size=100), size)
        t.expect(f"read_manifest_bytes, its true size given ({cls.__name__})",
                 partial(read_manifest_bytes, huge, size=size), ManifestError)
        with CheckpointWriter(store.child("good"), step=3) as w:
            w.put("a.bin", b"data")
        t.check(f"a good manifest still opens ({cls.__name__})",
                open_checkpoint(store.child("good")).step == 3)
        (root / "empty").mkdir()
        (root / "empty" / MANIFEST_NAME).write_bytes(b"")
        t.expect(f"an empty manifest ({cls.__name__})",
                 partial(open_checkpoint, store.child("empty")), ManifestError)
    t.report(record, "manifest reads without a size")


def _manifest_variants() -> list[tuple[str, bytes]]:
    good = Manifest(files={"a.bin": FileEntry(4, crc32c_hex(b"data"))}, step=7,
                    metadata={"note": "x"})
    base = json.loads(good.to_json())
    text = json.dumps(base)

    def doc(**changes: Any) -> bytes:
        d = json.loads(text)
        for k, v in changes.items():
            if v is _DROP:
                d.pop(k)
            else:
                d[k] = v
        return json.dumps(d).encode()

    def entry(**changes: Any) -> bytes:
        return doc(files={"a.bin": {"size": 4, "crc32c": crc32c_hex(b"data"), **changes}})

    def raw(field: str, literal: str) -> bytes:  # a value json.dumps cannot write
        marker = "__RAW__"
        return doc(**{field: marker}).replace(f'"{marker}"'.encode(), literal.encode())

    crc = crc32c_hex(b"data")
    deep_meta = text.replace('"metadata": {"note": "x"}',
                             '"metadata": ' + "[" * 100_000 + "]" * 100_000)
    return [
        ("empty", b""),
        ("truncated", text.encode()[:-5]),
        ("not JSON", b"<html>Access Denied</html>"),
        ("an array", b"[]"), ("null", b"null"), ("a number", b"42"), ("a string", b'"x"'),
        ("no format", doc(format=_DROP)), ("another format", doc(format="other")),
        ("version 99", doc(version=99)), ("version as string", doc(version="1")),
        ("files a list", doc(files=[])), ("files null", doc(files=None)),
        ("no files", doc(files=_DROP)),
        ("entry a list", doc(files={"a.bin": [4, crc]})),
        ("size a string", entry(size="4")), ("size negative", entry(size=-1)),
        ("size a float", entry(size=4.0)), ("size a bool", entry(size=True)),
        ("size missing", doc(files={"a.bin": {"crc32c": crc}})),
        ("size 10**30", entry(size=10**30)), ("size 2**63", entry(size=2**63)),
        ("size over 5 TiB", entry(size=6 * 1024**4)),
        ("size of 5000 digits", raw("files", '{"a.bin": {"size": ' + "9" * 5000
                                    + f', "crc32c": "{crc}"' + "}}")),
        ("size 1e999", raw("files", '{"a.bin": {"size": 1e999, "crc32c": "' + crc + '"}}')),
        ("crc not hex", entry(crc32c="zzzzzzzz")), ("crc an int", entry(crc32c=1234)),
        ("crc short", entry(crc32c="abc")), ("crc upper case", entry(crc32c=crc.upper())),
        ("crc null", entry(crc32c=None)),
        ("step a string", doc(step="7")), ("step a float", doc(step=7.5)),
        ("step a bool", doc(step=True)), ("step 10**30", doc(step=10**30)),
        ("metadata a list", doc(metadata=[1])), ("metadata a string", doc(metadata="x")),
        ("created a string", doc(created="yesterday")), ("created missing", doc(created=_DROP)),
        ("created a bool", doc(created=True)), ("created NaN", raw("created", "NaN")),
        ("created Infinity", raw("created", "Infinity")), ("created 1e400", raw("created",
                                                                                 "1e400")),
        ("created 10**400", raw("created", "1" + "0" * 400)),
        ("created 1e308", raw("created", "1e308")), ("created -1", doc(created=-1.0)),
        ("created 10**30", doc(created=10**30)), ("created after 9999", doc(created=2.6e11)),
        ("kind of 1000 characters", doc(kind="k" * 1000)),
        ("kind a list", doc(kind=["dcp"])), ("kind with escapes", doc(kind="\x1b[2Jdcp")),
        ("commit_id an object", doc(commit_id={"a": 1})),
        ("100000 [", b"[" * 100_000), ("100000 {", b'{"a":' * 100_000),
        ("5000 [ closed", b"[" * 5000 + b"]" * 5000),
        ("deep metadata", deep_meta.encode()),
        ("duplicate files key", text.replace('"files": {', '"files": {}, "files": {', 1)
         .encode()),
        ("duplicate path", raw("files", '{"a.bin": {"size": 4, "crc32c": "' + crc
                               + '"}, "a.bin": {"size": 4, "crc32c": "00000000"}}')),
        ("duplicate format", text.replace('"format": ', '"format": "x", "format": ', 1)
         .encode()),
        ("a 0xff byte", text.replace('"note": "x"', '"note": "\xff"').encode("latin-1")),
        ("latin-1 name", text.replace("a.bin", "\xe9.bin").encode("latin-1")),
        ("UTF-16", text.encode("utf-16")),
        ("UTF-8 with BOM", b"\xef\xbb\xbf" + text.encode()),
        ("lone surrogate name", text.replace("a.bin", "\\ud800.bin").encode()),
        ("escaped NUL name", text.replace("a.bin", "a\\u0000.bin").encode()),
    ]


_DROP = object()


def test_malformed_manifests_fail_cleanly(local, record) -> None:
    """Every malformed manifest is a ManifestError naming the file: never a
    RecursionError, KeyError, TypeError or OverflowError, and never accepted."""
    root = Path(local.root)
    store = open_store(local.root, local.options)
    t = Tally()

    def named(exc: BaseException) -> bool:
        return MANIFEST_NAME in str(exc) and len(str(exc)) < 2000

    variants = _manifest_variants()
    for i, (name, data) in enumerate(variants):
        t.trials += 1
        store.put(f"m-{i}/a.bin", b"data")
        (root / f"m-{i}" / MANIFEST_NAME).write_bytes(data)
        uri = str(root / f"m-{i}")
        t.expect(f"open: {name}", partial(open_checkpoint, uri, local.options), ManifestError,
                 check=named)
        code, out = _cli("info", uri)
        t.check(f"cli info: {name}", code == cli.EXIT_CORRUPT and "Traceback" not in out,
                f"exit {code}: {out[-300:]}")
    # random damage to a good manifest: parsed, or a ManifestError; nothing else
    good = Manifest(files={f"shard-{i}.bin": FileEntry(i, crc32c_hex(b"x" * i))
                           for i in range(4)}, step=3, metadata={"note": [1, 2]}).to_json()
    rng = random.Random(7)
    for _ in range(scale(200, 5000)):
        t.trials += 1
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data))
            if rng.random() < 0.3:
                del data[pos:pos + rng.randint(1, 20)]
            else:
                data[pos] = rng.randrange(256)
        try:
            Manifest.from_json(bytes(data), source=MANIFEST_NAME)
            t.attacks += 1
        except ManifestError as exc:
            t.check("damaged manifest", named(exc), str(exc))
        except Exception as exc:  # noqa: BLE001 - counted
            t.check("damaged manifest", False, f"{type(exc).__name__}: {exc}")
    t.trials += 1
    try:
        infos = list_checkpoints(local.root, local.options, include_uncommitted=True)
    except Exception as exc:  # noqa: BLE001 - counted
        t.check("list", False, f"{type(exc).__name__}: {exc}")
    else:
        t.check("list marks every one unreadable",
                all(not i.committed and i.error for i in infos) and len(infos) == len(variants),
                str([(i.name, i.committed) for i in infos if i.committed or not i.error]))
    t.report(record, "malformed manifests")


# ==================================================================== 4. pickles


class _Plant:
    """Pickles as a call that creates ``marker``: what a hostile checkpoint carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))

    def __deepcopy__(self, memo: dict[int, Any]) -> _Plant:
        return self  # snapshots taken at save time must not run it either


def _pickled(marker: Path) -> bytes:
    return pickle.dumps(_Plant(marker))


def _torch_saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _dotted_global(module: str, name: str, arg: str) -> bytes:
    """Protocol 4 resolves ``name`` with dots inside ``module``: ``os.system`` reached
    through a module that imports ``os``."""

    def text(s: str) -> bytes:
        b = s.encode()
        return b"X" + struct.pack("<I", len(b)) + b

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."


class _Loader:
    """A dataloader whose state holds planted code."""

    def __init__(self, plant: _Plant) -> None:
        self.plant = plant

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.plant}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _evil_tensor_item(store: Store, marker: Path) -> None:
    """Replace the DCP checkpoint's only tensor item by a pickle of planted code, with
    ``.metadata``, the item and file CRC32Cs all matching."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = cdcp.load_metadata(store.get(cdcp.METADATA_NAME))
    assert md.storage_data is not None
    index, info = next(iter(md.storage_data.items()))
    evil = _torch_saved(_Plant(marker))
    md.storage_data[index] = _StorageInfo(info.relative_path, 0, len(evil))
    raw_md = pickle.dumps(md)
    store.put(info.relative_path, evil)
    store.put(cdcp.METADATA_NAME, raw_md)

    def fix(doc: dict[str, Any]) -> None:
        for key, body in ((info.relative_path, evil), (cdcp.METADATA_NAME, raw_md)):
            doc["files"][key] = {"size": len(body), "crc32c": crc32c_hex(body)}
        doc["metadata"]["dcp"]["item_crcs"] = pack_item_crcs(
            [(info.relative_path, 0, crc32c_hex(evil))])

    _rewrite_manifest(store, "", fix)


def test_pickled_code_never_runs_from_dcp(local, tmp_path, record) -> None:
    """Planted code in DCP ``.metadata`` (plain and through a dotted global), in a byte
    item and in a tensor item, with every checksum right: every loader refuses it."""
    opts = local.options
    t = Tally()
    markers: list[Path] = []

    def marker(name: str) -> Path:
        markers.append(tmp_path / f"pwned-{name}")
        return markers[-1]

    def state() -> dict[str, Any]:
        return {"w": torch.zeros(4)}

    metadata_attacks = {
        "plain": _pickled(marker("metadata")),
        "dotted": _dotted_global("torch.distributed.checkpoint.metadata", "os.system",
                                 "touch " + shlex.quote(str(marker("metadata-dotted")))),
        "nested": pickle.dumps(Metadata(state_dict_metadata={},
                                        planner_data={"x": _Plant(marker("metadata-nested"))})),
    }
    for name, evil in metadata_attacks.items():
        t.trials += 1
        uri = local.uri(f"md-{name.replace(' ', '-')}")
        # The classic format: an indexed checkpoint's loads read JSON and records, and
        # never its .metadata.
        cdcp.save({"w": torch.ones(4)}, uri, storage_options=opts, step=1, indexed=False)
        _plant(open_store(uri, opts), cdcp.METADATA_NAME, evil)
        t.expect(f"dcp.load ({name} .metadata)", partial(cdcp.load, state(), uri,
                                                         storage_options=opts),
                 CorruptCheckpointError)
        t.expect(f"read_metadata ({name})", partial(cdcp.CloudStorageReader(
            uri, storage_options=opts).read_metadata), CorruptCheckpointError)
        t.expect(f"dcp_to_pt ({name})", partial(dcp_to_pt, uri, str(tmp_path / "o.pt"),
                                                storage_options=opts),
                 CorruptCheckpointError)
        code, out = _cli("convert", "dcp-to-pt", "--dcp_path", uri, "--output_path",
                         str(tmp_path / "o2.pt"))
        t.check(f"cli convert ({name})", code == cli.EXIT_CORRUPT, f"exit {code}: {out}")
        store = open_store(uri, opts)
        store.delete([MANIFEST_NAME])  # now stock-torch output waiting to be adopted
        t.expect(f"adopt ({name})", partial(cdcp.adopt, uri, opts), CorruptCheckpointError)
        code, out = _cli("adopt", uri)
        t.check(f"cli adopt ({name})", code == cli.EXIT_CORRUPT, f"exit {code}: {out}")

    t.trials += 1
    uri = local.uri("byte-item")
    evil = {"w": torch.ones(4), "evil": _Plant(marker("byte-item"))}
    # cloudckpt's save refuses it (checked with weights_only, so nothing runs) ...
    t.expect("dcp.save (byte item)", partial(cdcp.save, evil, uri, storage_options=opts),
             ConfigError)
    # ... torch's own dcp.save with cloudckpt's writer is the way to plant it.
    import torch.distributed.checkpoint as torch_dcp

    torch_dcp.save(evil, storage_writer=cdcp.CloudStorageWriter(uri, storage_options=opts,
                                                                 step=1), no_dist=True)
    t.expect("dcp.load (byte item)", partial(cdcp.load, {"w": torch.zeros(4), "evil": None},
                                              uri, storage_options=opts),
             CorruptCheckpointError)
    t.trials += 1
    uri = local.uri("tensor-item")
    cdcp.save({"w": torch.ones(4)}, uri, storage_options=opts, step=1)
    _evil_tensor_item(open_store(uri, opts), marker("tensor-item"))
    open_checkpoint(uri, opts).verify(deep=True)  # every checksum matches
    t.expect("dcp.load (tensor item)", partial(cdcp.load, state(), uri, storage_options=opts),
             CorruptCheckpointError)
    t.expect("dcp_to_pt (tensor item)", partial(dcp_to_pt, uri, str(tmp_path / "o3.pt"),
                                                storage_options=opts),
             CorruptCheckpointError)
    _nothing_ran(t, markers)
    t.report(record, "pickled code in DCP checkpoints")


def _nothing_ran(t: Tally, markers: list[Path]) -> None:
    for m in markers:
        t.check(f"{m.name} absent", not m.exists(), "the planted code ran")


def test_pickled_code_never_runs_from_training_state(local, tmp_path, record,
                                                     monkeypatch) -> None:
    """Planted code in the state part of training checkpoints (training, manager, slot),
    in AReaL's recover info, RLinf's ``data/data.pt``, an HF export and a ROLL download,
    checksums right: loaders refuse it; commands that only copy or show never run it."""
    opts = local.options
    t = Tally()
    markers: list[Path] = []

    def plant(name: str) -> _Plant:
        markers.append(tmp_path / f"pwned-{name}")
        return _Plant(markers[-1])

    # cloudckpt's own saves refuse such state before writing anything ...
    t.trials += 1
    t.expect("manager save refuses it", partial(
        CheckpointManager(local.uri("refused"), ManagerOptions(every_steps=1),
                          storage_options=opts).save,
        StepInfo(), {"w": torch.ones(4)}, extra={"evil": plant("refused")}, rng=False),
        ConfigError)
    # ... an attacker who writes the bucket does not ask them: plant with the checks off.
    monkeypatch.setattr(training, "check_restorable", lambda *a, **k: None)
    monkeypatch.setattr(state_module, "check_restorable", lambda *a, **k: None)

    # training checkpoints: shared and per-rank state
    for part in ("shared", "per_rank"):
        t.trials += 1
        uri = local.uri(f"train-{part}")
        evil = {"evil": plant(f"composite-{part}")}
        captured = training.capture(shared=evil if part == "shared" else None,
                                     per_rank=evil if part == "per_rank" else None, rng=False)
        training.write(uri, {"w": torch.ones(4)}, captured, training.WriteOptions(step=1),
                       storage_options=opts)
        t.expect(f"training.read ({part})", partial(
            training.read, uri, {"w": torch.zeros(4)}, training.ReadOptions(rng=False),
            per_rank={"evil": None},
            storage_options=opts), CorruptCheckpointError)
    t.trials += 1
    direct = plant("loads-state")
    for what, data in [("torch.save", b"T" + _torch_saved({"x": direct})),
                       ("plain pickle", b"T" + _pickled(Path(direct.marker))),
                       ("truncated", b"T" + _pickled(Path(direct.marker))[:-3]),
                       ("empty", b"T")]:
        t.expect(f"loads_state ({what})", partial(loads_state, data, source="state/x.bin"),
                 CorruptCheckpointError)
    # the manager, strict (raises) and not (falls back to a fresh start)
    t.trials += 1
    root = local.uri("managed")
    mgr = CheckpointManager(root, ManagerOptions(every_steps=1), storage_options=opts)
    mgr.save(StepInfo(), {"w": torch.ones(4)}, extra={"note": 1}, rng=False)
    mgr.save(StepInfo().next(), {"w": torch.ones(4)}, extra={"evil": plant("manager")},
             rng=False)
    mgr.close()
    t.expect("manager restore (strict)", partial(
        CheckpointManager(root, ManagerOptions(strict=True), storage_options=opts).restore,
        {"w": torch.zeros(4)}, rng=False), CorruptCheckpointError)
    restored = CheckpointManager(root, storage_options=opts).restore({"w": torch.zeros(4)},
                                                                     rng=False)
    t.check("manager restore falls back to the step before",
            restored is not None and restored.global_step == 0, str(restored))
    # AReaL: recover_info/dataloader_info.pkl in the slot's generation (a pickle, as AReaL's)
    t.trials += 1
    cfg = areal.RecoverConfig(experiment_name="sec", trial_name="t",
                              fileroot=local.uri("areal"), freq_steps=1, mode="on", user="u")
    loader = _Loader(plant("areal"))
    model = torch.nn.Linear(2, 2)
    handler = areal.RecoverHandler(cfg, 2, storage_options=opts)
    handler.dump(model, StepInfo(steps_per_epoch=2), None, None, None, loader)
    assert handler.slot.exists()
    t.expect("AReaL read_dataloader_info", partial(areal.read_dataloader_info, cfg,
                                                   storage_options=opts),
             CorruptCheckpointError)
    t.expect("AReaL recover load", partial(areal.RecoverHandler(cfg, 2, storage_options=opts)
                                           .load, model, None, None, None, loader),
             CorruptCheckpointError)
    # RLinf data/data.pt
    t.trials += 1
    ck = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(local.uri("rlinf"), "exp"),
                                 storage_options=opts)
    ck.save(1, {"fsdp_checkpoint": {"model": {"w": torch.ones(3)}}},
            data_state={"pos": plant("rlinf")})
    step_uri = ck.step_uri(1)
    t.expect("RLinf load", partial(ck.load, step_uri,
                                   {"fsdp_checkpoint": {"model": {"w": torch.zeros(3)}}}),
             CorruptCheckpointError)
    t.expect("RLinf read_data_state", partial(rlinf.read_data_state,
                                              open_checkpoint(step_uri, opts)),
             CorruptCheckpointError)
    # an HF export whose weights are a pickle: safetensors never unpickles
    t.trials += 1
    export = local.uri("hf-export")
    with CheckpointWriter(export, kind="hf", storage_options=opts) as w:
        w.put("model.safetensors", _torch_saved({"w": plant("hf")}))
        w.put("config.json", b"{}")
    t.expect("hf.load_state_dict", partial(hf.load_state_dict, export, opts), Exception)
    # ROLL: a download only copies files
    t.trials += 1
    roll_uri = local.uri("roll", "checkpoint-3")
    with CheckpointWriter(roll_uri, step=3, kind="roll", storage_options=opts) as w:
        w.put("actor/model.pt", _torch_saved({"w": plant("roll")}))
    t.check("ROLL download", Path(roll.download_checkpoint(roll_uri, tmp_path / "roll",
                                                           opts)).is_dir())
    # commands that show, check, list, copy or download never unpickle
    t.trials += 1
    for uri in (local.uri("train-shared"), step_uri, export, roll_uri):
        for args in (("info", uri), ("verify", "--deep", uri), ("ls", str(Path(uri).parent)),
                     ("cp", uri, str(tmp_path / "cp" / Path(uri).name)),
                     ("download", uri, str(tmp_path / "dl" / Path(uri).name))):
            code, out = _cli(*args)
            t.check(f"cli {args[0]} {Path(uri).name}", code == cli.EXIT_OK, out[-300:])
    _nothing_ran(t, markers)
    t.report(record, "pickled code in training state")


# ==================================================================== 5. secrets


def _texts_of(exc: BaseException) -> list[str]:
    """Everything an exception can show: str, repr and args of it and of its whole
    cause/context chain, and the formatted traceback."""
    out = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out += [str(e), repr(e), repr(e.args)]
        e = e.__cause__ or e.__context__
    return out


def _bucket_bytes(store: Store) -> list[tuple[str, bytes]]:
    return [(o.key, store.get(o.key)) for o in store.list()]


def _child_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_"))}
    return {**env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **extra}


def test_secrets_never_leak(s3, gcs, hub_server, s3_server, gcs_server, caplog,
                            monkeypatch, record) -> None:
    """Unique credentials (S3 secret and session token, a GCS token, Hub tokens) through
    operations that succeed and ones that fail (403, unreachable endpoint, wrong Hub
    token): not in any log line at DEBUG (botocore's included), exception text or
    traceback, CLI output (``-vvv``, every library's debug, too) or byte stored in the buckets."""
    run = uuid.uuid4().hex
    secret, token = f"s3-secret-{run}", f"s3-session-token-{run}"
    gcs_token, bad_hub_token = f"gcs-token-{run}", f"hf_wrong_{run}"
    hub_token = str(hub_server.token)
    secrets = [secret, token, gcs_token, bad_hub_token, hub_token]
    opts = {**s3.options, "secret": secret, "token": token}
    fail_fast = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.05,
                            deadline=3.0)
    gopts = {**gcs.options, "token": gcs_token}
    t = Tally()
    errors: list[BaseException] = []
    outputs: list[str] = []
    caplog.set_level(logging.DEBUG)  # every logger: cloudckpt's and the clients'

    def failing(what: str, fn: Callable[[], Any]) -> None:
        t.trials += 1
        exc = t.expect(what, fn, CloudCkptError, Exception)
        if exc is not None:
            errors.append(exc)

    # S3, working
    t.trials += 1
    uri = s3.uri("ok")
    with CheckpointWriter(uri, step=1, metadata={"run": "secure"}, storage_options=opts) as w:
        w.put("a.bin", b"alpha")
        with w.open("b.bin") as f:
            f.write(os.urandom(1024))
    open_checkpoint(uri, opts).verify(deep=True)
    copy_to(uri, s3.uri("copy"), opts)
    cdcp.save({"w": torch.ones(4)}, s3.uri("dcp"), storage_options=opts, step=2)
    cdcp.load({"w": torch.zeros(4)}, s3.uri("dcp"), storage_options=opts)
    hf.export({"w": torch.ones(2, 2)}, s3.uri("export"), config={"model_type": "x"},
              storage_options=opts)
    list_checkpoints(s3.root, opts)
    delete_checkpoint(s3.uri("copy"), opts)
    # S3, failing
    with FaultProxy(s3_server.endpoint, FaultPlan(permanent_status=403)) as proxy:
        denied = {**opts, "endpoint_url": proxy.endpoint, "retry": fail_fast}
        failing("403 on open", partial(open_checkpoint, uri, denied))
        failing("403 on write", partial(_write_one, s3.uri("denied"), denied))
    gone = {**opts, "endpoint_url": "http://127.0.0.1:9", "retry": fail_fast}
    failing("unreachable endpoint", partial(open_checkpoint, uri, gone))
    failing("missing bucket", partial(open_store(f"s3://no-such-bucket-{run[:8]}/x", opts).put,
                                      "x.bin", b"x"))
    failing("bad retry option", partial(open_store, uri, {**opts, "retry": {"bogus": 1}}))
    failing("unknown option", partial(open_store, "memory://x", {"secret": secret,
                                                                 "token": token}))
    # GCS: gcsfs first checks a raw token online, with the token in the URL; offline
    # (a dead proxy here) that check fails, and the error must not quote the token.
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    failing("GCS token check offline", partial(open_store, gcs.uri("ok"), gopts))
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("FETCH_RAW_TOKEN_EXPIRY", "false")  # then used as it is
    t.trials += 1
    with CheckpointWriter(gcs.uri("ok"), step=1, storage_options=gopts) as w:
        w.put("a.bin", b"alpha")
    open_checkpoint(gcs.uri("ok"), gopts).verify(deep=True)
    with FaultProxy(gcs_server.endpoint, FaultPlan(permanent_status=403)) as proxy:
        failing("GCS 403", partial(open_checkpoint, gcs.uri("ok"), {
            **gopts, "endpoint_url": proxy.endpoint, "retry": fail_fast}))
    # the Hub: a push that works, one with a wrong token, one in the background
    from cloudckpt.hf.hub import push_in_background, push_to_hub

    t.trials += 1
    push_to_hub(s3.uri("export"), "org/secure", token=hub_token, storage_options=opts,
                endpoint=hub_server.endpoint)
    failing("Hub wrong token", partial(push_to_hub, s3.uri("export"), "org/denied",
                                       token=bad_hub_token, storage_options=opts,
                                       endpoint=hub_server.endpoint))
    job = push_in_background(s3.uri("export"), "org/denied2", token=bad_hub_token,
                             storage_options=opts, endpoint=hub_server.endpoint)
    failing("Hub wrong token, background", partial(job.result, 60))
    # the CLI, options on the command line and credentials in the environment
    cli_opts = ["-o", f"endpoint_url={s3_server.endpoint}", "-o", f"key={s3.options['key']}",
                "-o", f"secret={secret}", "-o", f"token={token}", "-o",
                "retry=" + json.dumps({"max_attempts": 2, "initial_backoff": 0.01,
                                       "deadline": 3.0})]
    runs = [
        ([*cli_opts, "-vvv", "info", uri], {}),
        ([*cli_opts, "-vvv", "verify", "--deep", uri], {}),
        (["-vvv", "-o", "retry=" + json.dumps({"max_attempts": 2, "deadline": 3.0}), "ls",
          s3.root], {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "AKIDTEST",
                     "AWS_SECRET_ACCESS_KEY": secret, "AWS_SESSION_TOKEN": token,
                     "AWS_DEFAULT_REGION": "us-east-1"}),
    ]
    for argv, env in runs:
        t.trials += 1
        proc = subprocess.run([sys.executable, "-m", "cloudckpt", *argv], capture_output=True,
                              text=True, env=_child_env(env), timeout=120)
        outputs.append(proc.stdout + proc.stderr)
        t.check(f"cli {argv[-2]} ran", proc.returncode in (0, cli.EXIT_STORAGE),
                proc.stderr[-500:])
    # what was shown, raised, logged and stored
    t.trials += 1
    logged = [caplog.text, *caplog.messages]
    logged += ["".join(traceback.format_exception(r.exc_info[1])) for r in caplog.records
               if r.exc_info and r.exc_info[1] is not None]
    shown = [text for exc in errors for text in _texts_of(exc)]
    stored = _bucket_bytes(open_store(s3.root.rsplit("/", 2)[0], s3.options))
    stored += _bucket_bytes(open_store(gcs.root.rsplit("/", 2)[0], gcs.options))
    stored += [(f"hub:{p}", b) for p, b in hub_server.files("org/secure").items()]
    t.check("a log line was captured at DEBUG from botocore",
            any(r.name.startswith("botocore") and r.levelno == logging.DEBUG
                for r in caplog.records))
    for s in secrets:
        for where, texts in (("logs", logged), ("errors", shown), ("CLI output", outputs)):
            hits = [x for x in texts if s in x]
            t.check(f"{s[:12]}... not in {where}", not hits,
                    hits[0][max(0, hits[0].find(s) - 200):][:400] if hits else "")
        hits = [k for k, b in stored if s.encode() in b]
        t.check(f"{s[:12]}... not stored", not hits, str(hits))
    t.report(record, "secrets in logs, errors and storage")

