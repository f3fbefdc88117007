"""DCP save/load through cloudckpt versus torch's fsspec storage and plain s3fs or gcsfs.

Measures, in one single-process run (no process group) against a local S3
server (moto), on one state dict of ``--tensors`` float32 tensors totalling
``--size-mib``:

1. save: ``cloudckpt.dcp.save`` versus torch's ``FsspecWriter(thread_count=4,
   sync_files=False)`` versus a plain s3fs upload of the same bytes (each
   tensor's raw bytes as one object, ``fs.pipe({path: bytes})``);
2. load: ``cloudckpt.dcp.load`` into preallocated tensors versus torch's
   ``FsspecReader`` versus a plain s3fs ``fs.cat([paths])`` of the same bytes;
3. local disk: ``cloudckpt.dcp.save`` to a directory versus
   ``FileSystemWriter(thread_count=4)`` (both fsync their files);
4. async save: how long ``cloudckpt.dcp.async_save`` blocks the caller versus an
   in-memory clone of the state dict (best of ``--async-repeat``, medians shown);
5. peak RSS above the baseline during one ``cloudckpt.dcp.save`` to S3, and for
   comparison one ``FsspecWriter`` save and one s3fs pipe. Each is measured in a
   fresh child process (``/proc/self/statm`` sampled every 5 ms), after a small
   warm-up save, so that no side reuses heap that another one freed.

Each repetition runs every side, rotating which goes first; the best of
``--repeat`` repetitions is kept per side. Every save goes to a fresh prefix
(deleted afterwards, untimed). Before timing, one untimed round checks that
what each side wrote loads back equal to the state dict, and every timed load
is compared with it too, so a failing side cannot pass for a fast one. When
the moto server is ours, the CPU seconds it spent are shown per S3 run: on a
small machine the server is often the bottleneck, and what a side asks of it
(one PUT per object, or multipart; whole-object or ranged GETs) is the cost.

With ``--gcs`` the same save and load rounds (1 and 2: same rotation, best of
``--repeat``, same checks) run against a fake-gcs-server started on 127.0.0.1
instead, and only them: ``cloudckpt.dcp.save``/``load`` versus a plain gcsfs
``fs.pipe({path: bytes})``/``fs.cat([paths])`` of the same bytes cut as ours'
DCP files: one object per file, holding the raw bytes of that file's tensors
(the file's size less torch.save's framing, about 1.5 kB a tensor; both layouts
are printed), ``batch_size`` 16 as cloudckpt's default ``max_concurrency``.
Torch's fsspec sides, local disk, async save and RSS are not run there. An
emulator's speed is not GCS's: the ratios say what the client side costs, not
what a bucket will do.

Usage::

    python benchmarks/dcp_bench.py [--size-mib 256] [--tensors 16] [--repeat 3]
                                   [--async-repeat 5] [--endpoint URL | --gcs | --azure]

With ``--azure``, the save and load rounds against an Azurite, versus plain adlfs
and azure-storage-blob, and the peak extra RSS of a save and a load (see
``dcp_azure.py``).

Without ``--endpoint`` a moto server is started on 127.0.0.1 for the run. The
last line printed is a JSON summary of every figure and whether each target is
met; with ``--gcs`` or ``--azure``, under the key ``"gcs"`` or ``"azure"``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import s3fs
import torch
import torch.distributed.checkpoint as tdcp
from cloudckpt_testkit import FakeGcsServer, MotoServer
from memory import RssSampler  # benchmarks/memory.py: run as a script, its folder is on the path
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import cloudckpt.dcp as cdcp

MB = 1_000_000
MiB = 1024 * 1024
#: Targets: ours / baseline throughput (save, load, local) and blocking / clone time (async).
TARGETS = {
    "save_vs_fsspec": 2.0,
    "save_vs_s3fs": 0.85,
    "load_vs_fsspec": 3.0,
    "load_vs_s3fs": 0.8,
    "local_vs_filesystem": 1.0,
    "async_block_vs_clone": 2.0,  # an upper bound
}
#: With --gcs: ours / plain gcsfs throughput.
GCS_TARGETS = {"save_vs_gcsfs": 0.9, "load_vs_gcsfs": 0.9}
#: torch's FsspecWriter threads (one file each) and FileSystemWriter threads.
TORCH_THREADS = 4
#: Sides whose peak RSS during one S3 save is measured.
RSS_SIDES = ("ours", "fsspec", "s3fs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="cloudckpt DCP save/load versus torch FsspecWriter/Reader and plain s3fs "
                    "(or, with --gcs, plain gcsfs)."
    )
    p.add_argument("--size-mib", type=float, default=256.0,
                   help="state dict size in MiB (default 256)")
    p.add_argument("--tensors", type=int, default=16, help="float32 tensors (default 16)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; best is kept (default 3)")
    p.add_argument("--async-repeat", type=int, default=5,
                   help="async_save/clone repetitions; best is kept (default 5)")
    p.add_argument("--endpoint", default=None,
                   help="S3 endpoint URL; default: start a moto server on 127.0.0.1")
    p.add_argument("--gcs", action="store_true",
                   help="save and load against a fake-gcs-server started on 127.0.0.1, "
                        "versus plain gcsfs, instead of S3")
    p.add_argument("--azure", action="store_true",
                   help="save and load against an Azurite started on 127.0.0.1, versus "
                        "plain adlfs and azure-storage-blob (see dcp_azure.py)")
    p.add_argument("--bucket", default="cloudckpt-bench", help="bucket (created if missing)")
    p.add_argument("--key", default=os.environ.get("AWS_ACCESS_KEY_ID", MotoServer.ACCESS_KEY),
                   help="access key for --endpoint (default $AWS_ACCESS_KEY_ID or moto's)")
    p.add_argument("--secret",
                   default=os.environ.get("AWS_SECRET_ACCESS_KEY", MotoServer.SECRET_KEY),
                   help="secret key for --endpoint (default $AWS_SECRET_ACCESS_KEY or moto's)")
    p.add_argument("--baseline-pool", type=int, default=None, metavar="N",
                   help="max_pool_connections of the plain s3fs and torch fsspec clients "
                        "(default: botocore's, 10)")
    p.add_argument("--rss-side", choices=RSS_SIDES, default=None,
                   help=argparse.SUPPRESS)  # internal: one save in a child, for peak RSS
    p.add_argument("--local-dir", default=None,
                   help="parent directory for the local-disk saves (default: the temp dir)")
    args = p.parse_args(argv)
    if args.size_mib <= 0 or args.tensors < 1 or args.repeat < 1 or args.async_repeat < 1:
        p.error("--size-mib, --tensors, --repeat and --async-repeat must be positive")
    if args.gcs and args.azure:
        p.error("--gcs or --azure, not both")
    if (args.gcs or args.azure) and (args.endpoint or args.rss_side or args.baseline_pool):
        p.error("--gcs and --azure start their own server: no --endpoint or --baseline-pool")
    return args


# ----------------------------------------------------------------- helpers


def make_state(n: int, total: int) -> dict[str, torch.Tensor]:
    """``n`` float32 tensors of about ``total / n`` bytes each (random values)."""
    numel = max(1, total // 4 // n)
    g = torch.Generator().manual_seed(1234)
    shape = (numel // 1024, 1024) if numel % 1024 == 0 else (numel,)
    return {f"layer{i:03d}.weight": torch.rand(shape, generator=g) for i in range(n)}


def state_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def check_state(what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    if got.keys() != want.keys():
        raise SystemExit(f"FAIL {what}: keys differ: {sorted(set(got) ^ set(want))[:5]}")
    for k, v in want.items():
        if got[k].dtype != v.dtype or not torch.equal(got[k], v):
            raise SystemExit(f"FAIL {what}: tensor {k} differs from the one saved")


def check_raw(what: str, got: dict[str, bytes], want: dict[str, bytes]) -> None:
    if got.keys() != want.keys():
        raise SystemExit(f"FAIL {what}: keys differ")
    for k, v in want.items():
        if got[k] != v:
            raise SystemExit(f"FAIL {what}: {k} differs ({len(got[k])} bytes read, {len(v)})")


def raw_by_file(fs: Any, uri: str, raw: dict[str, bytes]) -> dict[str, bytes]:
    """One object per DCP file of the checkpoint at ``uri``: the raw bytes of the
    tensors in that file, in its order, from ``raw`` (tensor name -> bytes)."""
    meta = pickle.loads(fs.cat_file(f"{uri.split('://', 1)[1]}/{cdcp.METADATA_NAME}"))
    files: dict[str, list[tuple[int, str]]] = {}
    for index, info in meta.storage_data.items():
        files.setdefault(info.relative_path, []).append((info.offset, index.fqn))
    return {name.replace("/", "_"): b"".join(raw[fqn] for _, fqn in sorted(items))
            for name, items in sorted(files.items())}


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall seconds, server CPU seconds and result of ``fn()``."""
    gc.collect()
    c0 = server_cpu()
    t0 = time.perf_counter()
    out = fn()
    secs = time.perf_counter() - t0
    return secs, server_cpu() - c0, out


def ensure_bucket(endpoint: str, key: str, secret: str, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=key, aws_secret_access_key=secret)
    try:
        client.head_bucket(Bucket=bucket)
    except Exception:  # noqa: BLE001 - missing (or unreadable): try to create it
        client.create_bucket(Bucket=bucket)
    finally:
        client.close()


def pool_size(fs: s3fs.S3FileSystem) -> int:
    fs.connect()
    return int(fs.s3.meta.config.max_pool_connections)


def server_cpu() -> float:
    """CPU seconds used so far by this process's children (the moto server we started)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = f.read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


# ------------------------------------------------------------------- sides


#: Wall seconds and server CPU seconds (None: not shown) of one timed run, given the rep.
Timer = Callable[[int], tuple[float, float | None]]


class Bench:
    """The state dict, the clients and every side's save/load, on one endpoint.

    S3 (moto) by default; with ``gcs_options`` (gcsfs storage options) GCS, where
    the sides are ours and plain gcsfs only (no torch fsspec side).
    """

    ROOT = "dcp-bench"
    CONCURRENCY = 16  # ours: cloudckpt's default max_concurrency; s3fs/gcsfs pipe/cat batch_size

    def __init__(self, args: argparse.Namespace, endpoint: str, *, raw: bool = True,
                 gcs_options: dict[str, Any] | None = None) -> None:
        self.args = args
        self.endpoint = endpoint
        self.fs: Any
        if gcs_options is None:
            ensure_bucket(endpoint, args.key, args.secret, args.bucket)
            creds = {"endpoint_url": endpoint, "key": args.key, "secret": args.secret}
            self.base_opts: dict[str, Any] = dict(creds)
            if args.baseline_pool:
                self.base_opts["config_kwargs"] = {"max_pool_connections": args.baseline_pool}
            self.opts = dict(creds)  # ours: cloudckpt's defaults
            self.scheme, self.raw_side = "s3", "s3fs"
            # Plain s3fs, as a user would make it (its own instance, its defaults).
            self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.base_opts)
        else:
            # Imported here: after cloudckpt_testkit has set gcsfs's emulator default.
            import gcsfs

            self.base_opts = dict(gcs_options)
            self.opts = dict(gcs_options)  # ours: cloudckpt's defaults
            self.scheme, self.raw_side = "gs", "gcsfs"
            # Plain gcsfs, as a user would make it (its own instance, its defaults).
            self.fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **self.base_opts)
        self.save_fns: dict[str, Callable[[str], Any]] = {
            "ours": self.save_ours, "fsspec": self.save_fsspec, self.raw_side: self.save_raw}
        self.load_fns: dict[str, Callable[[str], Any]] = {
            "ours": self.load_ours, "fsspec": self.load_fsspec, self.raw_side: self.load_raw}
        # GCS: the plain client's objects are cut as ours' DCP files (group_raw_like).
        self.match_files = gcs_options is not None
        if self.match_files:
            del self.save_fns["fsspec"], self.load_fns["fsspec"]
        self.src: dict[str, str] = {}  # per side: what its timed loads read (write_sources)
        self.sd = make_state(args.tensors, int(args.size_mib * MiB))
        self.total = state_bytes(self.sd)
        self.names = list(self.sd)
        # The s3fs baseline's bytes, made untimed (a best case for it).
        self.raw = {n: raw_bytes(t) for n, t in self.sd.items()} if raw else {}
        self.dst: dict[str, torch.Tensor] = {}  # preallocated load targets, on first load
        self._counter = iter(range(1_000_000))

    def uri(self, kind: str) -> str:
        return f"{self.scheme}://{self.args.bucket}/{self.ROOT}/{kind}-{next(self._counter):04d}"

    def rm(self, uri: str) -> None:
        path = uri.split("://", 1)[1]
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache()

    def raw_paths(self, uri: str) -> dict[str, str]:
        return {n: f"{uri.split('://', 1)[1]}/{n}" for n in self.names}

    def clear_dst(self) -> dict[str, torch.Tensor]:
        if not self.dst:
            self.dst = {k: torch.empty_like(v) for k, v in self.sd.items()}
        for t in self.dst.values():
            t.fill_(float("nan"))
        return self.dst

    # -- saves ---------------------------------------------------------------
    def save_ours(self, uri: str) -> Any:
        return cdcp.save(self.sd, uri, storage_options=self.opts)

    def save_fsspec(self, uri: str) -> Any:
        writer = FsspecWriter(uri, thread_count=TORCH_THREADS, sync_files=False,
                              **self.base_opts)
        return tdcp.save(self.sd, storage_writer=writer, no_dist=True)

    def save_raw(self, uri: str) -> Any:
        paths = self.raw_paths(uri)
        return self.fs.pipe({paths[n]: self.raw[n] for n in self.names},
                            batch_size=self.CONCURRENCY)

    def save_local_ours(self, path: str) -> Any:
        return cdcp.save(self.sd, path)

    def save_local_torch(self, path: str) -> Any:
        writer = FileSystemWriter(path, thread_count=TORCH_THREADS)
        return tdcp.save(self.sd, storage_writer=writer, no_dist=True)

    # -- loads (into self.dst, preallocated) ---------------------------------
    def load_ours(self, uri: str) -> dict[str, torch.Tensor]:
        cdcp.load(self.dst, uri, storage_options=self.opts)
        return self.dst

    def load_fsspec(self, uri: str) -> dict[str, torch.Tensor]:
        tdcp.load(self.dst, storage_reader=FsspecReader(uri, **self.base_opts), no_dist=True)
        return self.dst

    def load_raw(self, uri: str) -> dict[str, bytes]:
        paths = self.raw_paths(uri)
        got = self.fs.cat(list(paths.values()), batch_size=self.CONCURRENCY)
        return {n: got[paths[n]] for n in self.names}

    # -- timed rounds ---------------------------------------------------------
    def write_sources(self) -> None:
        """Untimed: one save per side, which that side's timed loads then read; check
        that ours and the plain client's load back what was saved."""
        self.src = {side: self.uri(f"load-{side}") for side in self.save_fns}
        for side, fn in self.save_fns.items():  # ours first
            if side == self.raw_side and self.match_files:
                self.group_raw_like(self.src["ours"])
            fn(self.src[side])
        self.clear_dst()
        check_state("cloudckpt save -> cloudckpt load", self.load_ours(self.src["ours"]),
                    self.sd)
        raw = self.raw_side
        check_raw(f"{raw} pipe -> {raw} cat", self.load_raw(self.src[raw]), self.raw)

    def group_raw_like(self, uri: str) -> None:
        """One baseline object per DCP file of ours at ``uri``: the raw bytes of the
        tensors in that file, in its order (its size less torch.save's framing)."""
        self.raw = raw_by_file(self.fs, uri, self.raw)
        self.names = list(self.raw)

    def time_save(self, side: str, rep: int) -> tuple[float, float]:
        uri = self.uri(f"save-{side}")
        secs, cpu, _ = timed(lambda: self.save_fns[side](uri))
        self.rm(uri)
        return secs, cpu

    def time_load(self, side: str, rep: int) -> tuple[float, float]:
        self.clear_dst()
        secs, cpu, got = timed(lambda: self.load_fns[side](self.src[side]))
        if side == self.raw_side:
            check_raw(f"{side} cat (rep {rep})", got, self.raw)
        else:
            check_state(f"{side} load (rep {rep})", got, self.sd)
        del got
        return secs, cpu

    def timers(self) -> dict[str, dict[str, Timer]]:
        """The save and load phases of :func:`race`, every side of each."""
        return {"save": {side: partial(self.time_save, side) for side in self.save_fns},
                "load": {side: partial(self.time_load, side) for side in self.load_fns}}


def rss_child(args: argparse.Namespace) -> int:
    """``--rss-side SIDE``: one S3 save by SIDE in this fresh process; print its peak RSS.

    A fresh process, so that no side reuses heap another one freed. One small
    save first, so that clients, pools and imports are set up before the baseline.
    """
    side = args.rss_side
    bench = Bench(args, args.endpoint, raw=side == "s3fs")
    save = bench.save_fns[side]
    warm = argparse.Namespace(**{**vars(args), "size_mib": 1.0})
    small = Bench(warm, args.endpoint, raw=side == "s3fs")
    small.fs = bench.fs
    uri = bench.uri(f"rss-warmup-{side}")
    small.save_fns[side](uri)
    bench.rm(uri)
    uri = bench.uri(f"rss-{side}")
    with RssSampler() as sampler:
        save(uri)
    bench.rm(uri)
    print(json.dumps({"side": side, "rss_above": sampler.above, "samples": sampler.samples}))
    return 0


def measure_rss(args: argparse.Namespace, endpoint: str) -> dict[str, int]:
    rss: dict[str, int] = {}
    for side in RSS_SIDES:
        cmd = [sys.executable, os.path.abspath(__file__), "--rss-side", side,
               "--endpoint", endpoint, "--key", args.key, "--secret", args.secret,
               "--bucket", args.bucket, "--size-mib", str(args.size_mib),
               "--tensors", str(args.tensors)]
        if args.baseline_pool:
            cmd += ["--baseline-pool", str(args.baseline_pool)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"FAIL RSS measurement of {side}:\n{out.stderr[-2000:]}")
        rss[side] = int(json.loads(out.stdout.strip().splitlines()[-1])["rss_above"])
    return rss


# --------------------------------------------------------------------- run


def rotated(sides: list[str], rep: int) -> list[str]:
    k = rep % len(sides)
    return sides[k:] + sides[:k]


def race(phases: dict[str, dict[str, Timer]], repeat: int | range,
         total: int) -> tuple[dict[str, float], dict[str, float]]:
    """Each repetition (``repeat`` of them, or those of a range) runs every side of
    every phase, rotating which goes first, and prints a line per phase. Returns the
    best wall seconds per ``<phase>_<side>`` and the server CPU seconds of that run
    (0.0 where a phase shows none)."""
    best: dict[str, float] = {}
    best_cpu: dict[str, float] = {}
    reps = range(repeat) if isinstance(repeat, int) else repeat
    if reps.start == 0:
        print(f"\n{'rep':>3}  {'phase':<6} side: MB/s [server CPU s] (first listed ran "
              "first)", flush=True)
    for rep in reps:
        for phase, timers in phases.items():
            cells = []
            for side in rotated(list(timers), rep):
                secs, cpu = timers[side](rep)
                key = f"{phase}_{side}"
                if secs < best.get(key, float("inf")):
                    best[key], best_cpu[key] = secs, cpu or 0.0
                shown = "" if cpu is None else f" [{cpu:4.2f}]"
                cells.append(f"{side}: {total / secs / MB:7.1f}{shown}")
            print(f"{rep:>3}  {phase:<6} " + "  ".join(f"{c:>22}" for c in cells), flush=True)
    return best, best_cpu


def mb_per_s(best: dict[str, float], total: int) -> dict[str, float]:
    return {k: round(total / s / MB, 1) for k, s in best.items()
            if k.startswith(("save_", "load_", "local_"))}


def print_rows(rows: list[tuple[str, str, str, str, str]], mbps: dict[str, float],
               ratios: dict[str, float], met: dict[str, bool],
               targets: dict[str, float]) -> None:
    """One line per ``(ratio key, what, ours key, baseline key, baseline name)``."""
    for key, what, ours_k, base_k, base_name in rows:
        verdict = "ok" if met[key] else "MISSED"
        print(f"  {what:<10}: ours {mbps[ours_k]:7.1f} MB/s  {base_name} {mbps[base_k]:7.1f} "
              f"MB/s  ratio {ratios[key]:5.2f}  target >= {targets[key]:g}x  [{verdict}]")


def server_cpu_s(best_cpu: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in best_cpu.items() if k.startswith(("save_", "load_"))}


def print_server_cpu(name: str, best_cpu: dict[str, float]) -> None:
    if any(best_cpu.values()):
        print(f"  server ({name}) CPU s in the best runs: " + ", ".join(
            f"{k} {v:.2f}" for k, v in server_cpu_s(best_cpu).items()))


def run(args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    print(f"peak RSS: one S3 save per side, each in a fresh process ({', '.join(RSS_SIDES)}) "
          "...", flush=True)
    rss = measure_rss(args, endpoint)

    print(f"generating {args.tensors} float32 tensors, {args.size_mib:g} MiB in all ...",
          flush=True)
    b = Bench(args, endpoint)
    sd, total, fs, opts = b.sd, b.total, b.fs, b.opts
    rm, clear_dst, load_ours, load_fsspec = b.rm, b.clear_dst, b.load_ours, b.load_fsspec
    local_parent = tempfile.mkdtemp(prefix="cloudckpt-dcp-bench-", dir=args.local_dir)
    counter = iter(range(1_000_000))

    def local_dir(kind: str) -> str:
        return os.path.join(local_parent, f"{kind}-{next(counter):04d}")

    # -- untimed correctness round; also writes the load sources ------------
    print("verifying (untimed): each side's checkpoint loads back equal ...", flush=True)
    b.write_sources()
    src = b.src
    clear_dst()
    dst = b.dst
    check_state("cloudckpt save -> FsspecReader", load_fsspec(src["ours"]), sd)
    clear_dst()
    check_state("FsspecWriter -> cloudckpt load (adopted copy)", _adopted_load(
        src["fsspec"], b.uri("adopt"), fs, opts, dst, rm), sd)
    clear_dst()
    check_state("FsspecWriter -> FsspecReader", load_fsspec(src["fsspec"]), sd)
    path = local_dir("verify-ours")
    b.save_local_ours(path)
    clear_dst()
    tdcp.load(dst, storage_reader=FileSystemReader(path), no_dist=True)
    check_state("cloudckpt local save -> FileSystemReader", dst, sd)
    shutil.rmtree(path)
    uri = b.uri("verify-async")
    cdcp.async_save(sd, uri, storage_options=opts).result()
    clear_dst()
    check_state("cloudckpt async_save -> cloudckpt load", load_ours(uri), sd)
    rm(uri)

    ours_pool = pool_size(cdcp.CloudStorageWriter(src["ours"], storage_options=opts).store.fs)
    print(f"\nstate dict: {args.tensors} float32 tensors, {total / MiB:.0f} MiB "
          f"({total / MB:.0f} MB); endpoint {endpoint}; local dir {local_parent}\n"
          f"S3 connection pools: ours {ours_pool} (max_concurrency 16), s3fs/torch fsspec "
          f"{pool_size(fs)}; "
          f"s3fs pipe/cat batch_size {b.CONCURRENCY}; FsspecWriter thread_count "
          f"{TORCH_THREADS}, sync_files=False; local: ours fsync=True (default), "
          f"FileSystemWriter sync_files=True (default), thread_count {TORCH_THREADS}",
          flush=True)

    local_fns = {"ours": b.save_local_ours, "torch": b.save_local_torch}

    def time_local(side: str, rep: int) -> tuple[float, None]:
        path = local_dir(f"local-{side}")
        os.sync()
        secs, _, _ = timed(lambda: local_fns[side](path))
        shutil.rmtree(path)
        return secs, None

    best, best_cpu = race({**b.timers(),
                           "local": {side: partial(time_local, side) for side in local_fns}},
                          args.repeat, total)

    # Async: cheap to block for, so more samples (the time of an allocation plus a
    # copy varies a lot with what the allocator has at hand).
    samples: dict[str, list[float]] = {"async_block": [], "clone": [], "async_total": []}
    for rep in range(args.async_repeat):
        cells = []
        for side in rotated(["async", "clone"], rep):
            if side == "clone":
                secs, _, copy = timed(lambda: {k: v.clone() for k, v in sd.items()})
                del copy
                samples["clone"].append(secs)
                cells.append(f"clone {secs:6.3f}s")
                continue
            uri = b.uri("async")
            gc.collect()
            t0 = time.perf_counter()
            fut = cdcp.async_save(sd, uri, storage_options=opts)
            blocked = time.perf_counter() - t0
            fut.result()
            done = time.perf_counter() - t0
            rm(uri)
            samples["async_block"].append(blocked)
            samples["async_total"].append(done)
            cells.append(f"async_save blocks {blocked:6.3f}s (saved after {done:.2f}s)")
        print(f"{rep:>3}  {'async':<6} " + "  ".join(cells), flush=True)
    for key, values in samples.items():
        best[key] = min(values)
    median = {k: statistics.median(v) for k, v in samples.items()}

    for uri in src.values():
        rm(uri)
    shutil.rmtree(local_parent, ignore_errors=True)

    mbps = mb_per_s(best, total)
    ratios = {
        "save_vs_fsspec": best["save_fsspec"] / best["save_ours"],
        "save_vs_s3fs": best["save_s3fs"] / best["save_ours"],
        "load_vs_fsspec": best["load_fsspec"] / best["load_ours"],
        "load_vs_s3fs": best["load_s3fs"] / best["load_ours"],
        "local_vs_filesystem": best["local_torch"] / best["local_ours"],
        "async_block_vs_clone": best["async_block"] / best["clone"],
    }
    met = {k: (r <= TARGETS[k] if k == "async_block_vs_clone" else r >= TARGETS[k])
           for k, r in ratios.items()}

    print(f"\nbest of {args.repeat} (MB = 10^6 bytes):")
    print_rows([
        ("save_vs_fsspec", "S3 save", "save_ours", "save_fsspec", "FsspecWriter"),
        ("save_vs_s3fs", "S3 save", "save_ours", "save_s3fs", "s3fs pipe"),
        ("load_vs_fsspec", "S3 load", "load_ours", "load_fsspec", "FsspecReader"),
        ("load_vs_s3fs", "S3 load", "load_ours", "load_s3fs", "s3fs cat"),
        ("local_vs_filesystem", "local save", "local_ours", "local_torch",
         "FileSystemWriter (both fsync)"),
    ], mbps, ratios, met, TARGETS)
    key = "async_block_vs_clone"
    print(f"  async save: blocks {best['async_block']:.3f}s, clone {best['clone']:.3f}s  ratio "
          f"{ratios[key]:5.2f}  target <= {TARGETS[key]:g}x  [{'ok' if met[key] else 'MISSED'}]"
          f"  (best of {args.async_repeat}; medians: blocks {median['async_block']:.3f}s, "
          f"clone {median['clone']:.3f}s; saved after {best['async_total']:.2f}s)")
    print(f"  peak RSS above baseline during one S3 save: ours {rss['ours'] / MiB:.0f} MiB, "
          f"FsspecWriter {rss['fsspec'] / MiB:.0f} MiB, s3fs pipe {rss['s3fs'] / MiB:.0f} MiB "
          f"(of bytes already in memory); state {total / MiB:.0f} MiB")
    print_server_cpu("moto", best_cpu)

    summary: dict[str, Any] = {f"{k}_MBps": v for k, v in mbps.items()}
    summary.update({k: round(r, 3) for k, r in ratios.items()})
    summary.update({
        "async_block_s": round(best["async_block"], 4),
        "clone_s": round(best["clone"], 4),
        "async_total_s": round(best["async_total"], 3),
        "async_block_median_s": round(median["async_block"], 4),
        "clone_median_s": round(median["clone"], 4),
        "server_cpu_s": {k: round(v, 2) for k, v in server_cpu_s(best_cpu).items()},
        "rss_peak_above_MiB": round(rss["ours"] / MiB, 1),
        "rss_peak_above_fsspec_MiB": round(rss["fsspec"] / MiB, 1),
        "rss_peak_above_s3fs_MiB": round(rss["s3fs"] / MiB, 1),
        "state_MiB": round(total / MiB, 1),
        "tensors": args.tensors,
        "repeat": args.repeat,
        "targets": TARGETS,
        "met": met,
        "all_met": all(met.values()),
    })
    return summary


def run_gcs(args: argparse.Namespace, endpoint: str,
            storage_options: dict[str, Any]) -> dict[str, Any]:
    """``--gcs``: the save and load rounds, ours versus plain gcsfs, on fake-gcs-server."""
    print(f"generating {args.tensors} float32 tensors, {args.size_mib:g} MiB in all ...",
          flush=True)
    b = Bench(args, endpoint, gcs_options=storage_options)
    total = b.total
    print("verifying (untimed): each side's checkpoint loads back equal ...", flush=True)
    b.write_sources()

    # The objects each side reads and writes: the baseline's are ours' DCP files' tensors.
    ours = sorted(size for name, size in b.fs.du(b.src["ours"].split("://", 1)[1],
                                                 total=False).items()
                  if name.endswith(".distcp"))
    raw = sorted(len(v) for v in b.raw.values())
    print(f"\nstate dict: {args.tensors} float32 tensors, {total / MiB:.0f} MiB "
          f"({total / MB:.0f} MB); endpoint {endpoint} (fake-gcs-server)\n"
          f"GCS: ours cloudckpt defaults (max_concurrency {b.CONCURRENCY}); gcsfs pipe/cat "
          f"batch_size {b.CONCURRENCY}; objects: ours {len(ours)} DCP files of "
          f"{ours[0]:,}-{ours[-1]:,} bytes, gcsfs {len(raw)} of {raw[0]:,}-{raw[-1]:,} bytes "
          "(the tensors of each DCP file)", flush=True)

    best, best_cpu = race(b.timers(), args.repeat, total)
    for uri in b.src.values():
        b.rm(uri)

    mbps = mb_per_s(best, total)
    ratios = {"save_vs_gcsfs": best["save_gcsfs"] / best["save_ours"],
              "load_vs_gcsfs": best["load_gcsfs"] / best["load_ours"]}
    met = {k: r >= GCS_TARGETS[k] for k, r in ratios.items()}
    print(f"\nbest of {args.repeat} (MB = 10^6 bytes):")
    print_rows([
        ("save_vs_gcsfs", "GCS save", "save_ours", "save_gcsfs", "gcsfs pipe"),
        ("load_vs_gcsfs", "GCS load", "load_ours", "load_gcsfs", "gcsfs cat"),
    ], mbps, ratios, met, GCS_TARGETS)
    print_server_cpu("fake-gcs-server", best_cpu)

    gcs: dict[str, Any] = {f"{k}_MBps": v for k, v in mbps.items()}
    gcs.update({k: round(r, 3) for k, r in ratios.items()})
    gcs.update({
        "server_cpu_s": {k: round(v, 2) for k, v in server_cpu_s(best_cpu).items()},
        "objects": {"ours": len(ours), "gcsfs": len(raw)},
        "state_MiB": round(total / MiB, 1),
        "tensors": args.tensors,
        "repeat": args.repeat,
        "targets": GCS_TARGETS,
        "met": met,
        "all_met": all(met.values()),
    })
    return {"gcs": gcs}


def _adopted_load(src: str, dest: str, fs: s3fs.S3FileSystem, opts: dict[str, Any],
                  dst: dict[str, torch.Tensor], rm: Callable[[str], None]) -> dict:
    """Load stock torch output with cloudckpt: copy it, adopt the copy, load, delete."""
    fs.copy(src.split("://", 1)[1], dest.split("://", 1)[1], recursive=True)
    cdcp.adopt(dest, opts)
    cdcp.load(dst, dest, storage_options=opts)
    rm(dest)
    return dst


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Single process on purpose (no process group): silence DCP's notice about it.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.rss_side:
        if not args.endpoint:
            raise SystemExit("--rss-side needs --endpoint")
        return rss_child(args)
    if args.azure:
        from dcp_azure import run_azure

        print(json.dumps(run_azure(args)))
        return 0
    server: MotoServer | FakeGcsServer | None = None
    endpoint = args.endpoint
    if args.gcs:
        server = FakeGcsServer()
        server.start()
        endpoint = server.endpoint
    elif endpoint is None:
        server = MotoServer()
        server.start()
        endpoint = server.endpoint
        args.key, args.secret = MotoServer.ACCESS_KEY, MotoServer.SECRET_KEY
    try:
        if isinstance(server, FakeGcsServer):
            server.create_bucket(args.bucket)
            summary = run_gcs(args, endpoint, server.storage_options())
        else:
            summary = run(args, endpoint)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
