"""Extra peak host memory (RSS) and time of checkpoint saves and loads, ours and peers'.

Host memory is what large checkpoints die of (issue 14), so this measures, for
each state size in ``--sizes`` (``--tensors`` float32 tensors of equal size),
how much RSS each of these needs beyond what the process held before:

* ``ours-s3``: ``cloudckpt.dcp.save`` / ``load`` to S3 (moto);
* ``ours-local``: the same to a local directory;
* ``fsspec``: torch's ``FsspecWriter(thread_count=4)`` / ``FsspecReader`` (s3fs);
* ``s3tc``: AWS s3torchconnector's ``S3StorageWriter(thread_count=4)`` /
  ``S3StorageReader``; not a cloudckpt dependency: ``pip install s3torchconnector``.
  It is pointed at moto through ``AWS_ENDPOINT_URL`` (its CRT client reads it),
  region us-east-1 and ``S3ClientConfig(force_path_style=True)``;
* ``async``: ``cloudckpt.dcp.async_save`` until the checkpoint is committed
  with a staging budget of ``--budget`` of the state (0.25 by default): the
  JSON has how long the call blocked (``blocked_s``);
* ``hf``: ``cloudckpt.hf.export`` of the plain state dict to S3.

How: the parent starts one moto server and runs every case in a fresh child
process (so no case reuses heap another one freed). The child makes its state
(or, for a load, preallocated destination tensors, written once so that their
pages are resident), does a small warm-up save (and load) of the same kind so
that imports, clients and thread pools exist, trims the heap, and measures
the call: extra = peak RSS during the call (the kernel's high-water mark,
reset just before, and samples every 5 ms) minus RSS just before it. Every
save is then checked complete (ours: ``open_checkpoint(uri).verify()``; torch
format: every storage entry of ``.metadata`` lies inside an existing object)
and every load bit-exact against the state saved, so a broken side never
reports a figure.

Usage::

    python benchmarks/memory_bench.py [--sizes 256M,1G,2G] [--tensors 16]
        [--cases ours-s3,ours-local,fsspec,s3tc,async,hf] [--json memory-bench.json]

Prints a table and same-run ratios against the peers; writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import s3fs
import torch
import torch.distributed.checkpoint as tdcp
from _rss import PeakRss  # benchmarks/_rss.py: run as a script, its folder is on the path
from cloudckpt_testkit import MotoServer
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import cloudckpt.dcp as cdcp
from cloudckpt import hf, open_checkpoint

MiB = 1024 * 1024
UNITS = {"": 1, "K": 1024, "M": MiB, "G": 1024 * MiB}
BUCKET = "memory-bench"
REGION = MotoServer.REGION
#: torch's and s3torchconnector's writer threads (as in issue 14's figures).
THREADS = 4
#: Total size of the warm-up state: enough to set every client up, small beside any case.
WARM_BYTES = MiB
#: Sides in the order they run; a side's save writes what its load reads.
SIDES = ("ours-s3", "ours-local", "fsspec", "s3tc", "async", "hf")
LOADS = ("ours-s3", "ours-local", "fsspec", "s3tc")
LABELS = {
    "ours-s3": "cloudckpt dcp S3",
    "ours-local": "cloudckpt dcp local",
    "fsspec": "torch Fsspec S3",
    "s3tc": "s3torchconnector S3",
    "async": "cloudckpt async S3",
    "hf": "cloudckpt hf.export S3",
}


def parse_size(text: str) -> int:
    """``256M`` / ``1G`` / ``1.5G`` / ``4096`` (binary units) -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t[-1:] in ("K", "M", "G") else ""
    return int(float(t[: len(t) - len(unit)]) * UNITS[unit])


def fmt_size(n: int) -> str:
    return f"{n / (1024 * MiB):g} GiB" if n >= 1024 * MiB else f"{n / MiB:g} MiB"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256M,1G,2G",
                   help="comma-separated state sizes, binary units (default 256M,1G,2G)")
    p.add_argument("--tensors", type=int, default=16, help="float32 tensors (default 16)")
    p.add_argument("--cases", default=",".join(SIDES),
                   help=f"comma-separated sides to run (default all: {','.join(SIDES)})")
    p.add_argument("--budget", type=float, default=0.25,
                   help="async staging budget as a fraction of the state (default 0.25)")
    p.add_argument("--json", default="memory-bench.json", help="where to write the figures")
    p.add_argument("--local-dir", default=None,
                   help="parent directory for local saves (default: the temp dir)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: "side:op"
    p.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.sides = [s.strip() for s in args.cases.split(",") if s.strip()]
    unknown = set(args.sides) - set(SIDES)
    if unknown:
        p.error(f"unknown --cases {sorted(unknown)}; choose from {','.join(SIDES)}")
    if args.tensors < 1 or not args.size_list or min(args.size_list) < 4 * args.tensors:
        p.error("--tensors must be positive and every size at least 4 bytes per tensor")
    if not 0 < args.budget <= 1:
        p.error("--budget is a fraction of the state in (0, 1]")
    return args


# ------------------------------------------------------------------ states


def tensor_shapes(n: int, total: int) -> list[tuple[int, ...]]:
    numel = max(1, total // 4 // n)
    shape = (numel // 1024, 1024) if numel % 1024 == 0 else (numel,)
    return [shape] * n


def names(n: int) -> list[str]:
    return [f"layers.{i:03d}.weight" for i in range(n)]


def expected(n: int, total: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The state's tensors one at a time (seeded), so a check never holds two states."""
    g = torch.Generator().manual_seed(1234)
    for name, shape in zip(names(n), tensor_shapes(n, total), strict=True):
        yield name, torch.rand(shape, generator=g)


def make_state(n: int, total: int) -> dict[str, torch.Tensor]:
    return dict(expected(n, total))


def make_dst(n: int, total: int) -> dict[str, torch.Tensor]:
    """Load destinations, written once: untouched pages would count as the load's memory."""
    return {k: torch.full(s, float("nan")) for k, s in
            zip(names(n), tensor_shapes(n, total), strict=True)}


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


# ------------------------------------------------------------- where things go


@dataclass(frozen=True)
class Place:
    """Where a side's checkpoints go, and the options to reach them."""

    endpoint: str
    local_root: str
    budget: float

    @property
    def opts(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "key": MotoServer.ACCESS_KEY,
                "secret": MotoServer.SECRET_KEY}

    def uri(self, side: str, size: int, what: str = "ckpt") -> str:
        if side == "ours-local":
            return os.path.join(self.local_root, f"{side}-{size}", what)
        return f"s3://{BUCKET}/{side}-{size}/{what}"


def s3tc_config() -> Any:
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)  # moto serves path-style only


# ------------------------------------------------------------------ saves


def save_ours_s3(sd: dict, uri: str, where: Place) -> dict[str, Any]:
    cdcp.save(sd, uri, storage_options=where.opts)
    return {}


def save_ours_local(sd: dict, uri: str, where: Place) -> dict[str, Any]:
    cdcp.save(sd, uri)
    return {}


def save_fsspec(sd: dict, uri: str, where: Place) -> dict[str, Any]:
    writer = FsspecWriter(uri, thread_count=THREADS, sync_files=False, **where.opts)
    tdcp.save(sd, storage_writer=writer, no_dist=True)
    return {}


def save_s3tc(sd: dict, uri: str, where: Place) -> dict[str, Any]:
    from s3torchconnector.dcp import S3StorageWriter

    writer = S3StorageWriter(REGION, uri, s3client_config=s3tc_config(), thread_count=THREADS)
    tdcp.save(sd, storage_writer=writer, no_dist=True)
    return {}


def save_async(sd: dict, uri: str, where: Place) -> dict[str, Any]:
    t0 = time.perf_counter()
    fut = cdcp.async_save(sd, uri, storage_options=where.opts,
                          staging_budget=int(where.budget * nbytes(sd)))
    blocked = time.perf_counter() - t0
    fut.result()
    return {"blocked_s": round(blocked, 4)}


def save_hf(sd: dict, uri: str, where: Place) -> dict[str, Any]:
    hf.export(sd, uri, config={"model_type": "llama"}, storage_options=where.opts)
    return {}


SAVES: dict[str, Callable[[dict, str, Place], dict[str, Any]]] = {
    "ours-s3": save_ours_s3, "ours-local": save_ours_local, "fsspec": save_fsspec,
    "s3tc": save_s3tc, "async": save_async, "hf": save_hf,
}


# ------------------------------------------------------------------ loads


def load_ours_s3(dst: dict, uri: str, where: Place) -> None:
    cdcp.load(dst, uri, storage_options=where.opts)


def load_ours_local(dst: dict, uri: str, where: Place) -> None:
    cdcp.load(dst, uri)


def load_fsspec(dst: dict, uri: str, where: Place) -> None:
    tdcp.load(dst, storage_reader=FsspecReader(uri, **where.opts), no_dist=True)


def load_s3tc(dst: dict, uri: str, where: Place) -> None:
    from s3torchconnector.dcp import S3StorageReader

    reader = S3StorageReader(REGION, uri, s3client_config=s3tc_config())
    tdcp.load(dst, storage_reader=reader, no_dist=True)


LOADERS: dict[str, Callable[[dict, str, Place], None]] = {
    "ours-s3": load_ours_s3, "ours-local": load_ours_local, "fsspec": load_fsspec,
    "s3tc": load_s3tc,
}


# ----------------------------------------------------------------- checks


def check_saved(side: str, uri: str, where: Place, n: int) -> None:
    """The checkpoint is complete, or SystemExit: a broken save must not report a figure."""
    if side in ("fsspec", "s3tc"):
        check_torch_format(uri, where, n)
        return
    opts = None if side == "ours-local" else where.opts
    open_checkpoint(uri, opts).verify()


def check_torch_format(uri: str, where: Place, n: int) -> None:
    """Every tensor of the state is in ``.metadata``, inside an object that exists."""
    md = FsspecReader(uri, **where.opts).read_metadata()
    missing = set(names(n)) - set(md.state_dict_metadata)
    if missing:
        raise SystemExit(f"FAIL {uri}: .metadata lacks {sorted(missing)[:3]}")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **where.opts)
    root = uri.split("://", 1)[1]
    sizes: dict[str, int] = {}
    for info in md.storage_data.values():
        path = f"{root}/{info.relative_path}"
        if path not in sizes:
            sizes[path] = fs.info(path)["size"] if fs.exists(path) else -1
        if sizes[path] < info.offset + info.length:
            raise SystemExit(f"FAIL {uri}: {info.relative_path} is missing or short "
                             f"({sizes[path]} bytes, needs {info.offset + info.length})")


def check_loaded(dst: dict[str, torch.Tensor], n: int, total: int) -> None:
    for name, want in expected(n, total):
        if not torch.equal(dst[name], want):
            raise SystemExit(f"FAIL load: {name} differs from the tensor saved")


# ------------------------------------------------------------------ child


def child(args: argparse.Namespace) -> int:
    """One case in this fresh process: warm up, measure one call, check it, print JSON."""
    side, op = args.child.split(":")
    where = Place(args.endpoint, args.local_dir, args.budget)
    n, total = args.tensors, args.size
    warm_up(side, op, where, n)
    uri = where.uri(side, total)
    if op == "save":
        sd = make_state(n, total)
        with PeakRss() as mem:
            t0 = time.perf_counter()
            extra = SAVES[side](sd, uri, where)
            secs = time.perf_counter() - t0
        check_saved(side, uri, where, n)
    else:
        sd = make_dst(n, total)
        with PeakRss() as mem:
            t0 = time.perf_counter()
            LOADERS[side](sd, uri, where)
            secs = time.perf_counter() - t0
        check_loaded(sd, n, total)
        extra = {}
    print(json.dumps({"side": side, "op": op, "state_bytes": nbytes(sd), "seconds": secs,
                      "extra_bytes": mem.above, "baseline_bytes": mem.baseline,
                      "samples": mem.samples, "kernel_hwm": mem.hwm, **extra}))
    return 0


def warm_up(side: str, op: str, where: Place, n: int) -> None:
    """A small save (and load) of the same kind, so the measured call sets nothing up."""
    uri = where.uri(side, WARM_BYTES, f"warm-{op}")
    SAVES[side](make_state(n, WARM_BYTES), uri, where)
    check_saved(side, uri, where, n)
    if op == "load":
        dst = make_dst(n, WARM_BYTES)
        LOADERS[side](dst, uri, where)
        check_loaded(dst, n, WARM_BYTES)


# ----------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, side: str, op: str, size: int, endpoint: str,
              local_root: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{side}:{op}",
           "--size", str(size), "--tensors", str(args.tensors), "--endpoint", endpoint,
           "--local-dir", local_root, "--budget", str(args.budget)]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": MotoServer.ACCESS_KEY,
           "AWS_SECRET_ACCESS_KEY": MotoServer.SECRET_KEY, "AWS_DEFAULT_REGION": REGION,
           "AWS_REGION": REGION}
    env.pop("AWS_ENDPOINT_URL", None)
    if side == "s3tc":
        env["AWS_ENDPOINT_URL"] = endpoint  # s3torchconnector's CRT client reads it
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-15:]
        return {"side": side, "op": op, "error": "\n".join(tail)}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_side(args: argparse.Namespace, server: MotoServer, side: str, size: int,
             local_root: str) -> list[dict[str, Any]]:
    """The side's save, then its load (of what the save wrote); then a clean slate."""
    rows = []
    for op in ("save", "load") if side in LOADS else ("save",):
        t0 = time.perf_counter()
        row = run_child(args, side, op, size, server.endpoint, local_root)
        row.update(size=size, label=LABELS[side], child_s=round(time.perf_counter() - t0, 1))
        print(f"  {describe(row)}", flush=True)
        rows.append(row)
        if "error" in row:
            break  # a failed save leaves nothing to load
    server.reset()
    server.create_bucket(BUCKET)
    shutil.rmtree(os.path.join(local_root, f"{side}-{size}"), ignore_errors=True)
    shutil.rmtree(os.path.join(local_root, f"{side}-{WARM_BYTES}"), ignore_errors=True)
    return rows


def describe(row: dict[str, Any]) -> str:
    head = f"{row['label']:<24} {row['op']:<5} {fmt_size(row['size']):>8}"
    if "error" in row:
        return f"{head}  FAILED:\n    " + row["error"].replace("\n", "\n    ")
    mib = row["extra_bytes"] / MiB
    ratio = row["extra_bytes"] / row["state_bytes"]
    rate = row["state_bytes"] / MiB / row["seconds"]
    note = f"  blocks {row['blocked_s']:.3f}s" if "blocked_s" in row else ""
    return (f"{head} {mib:9.1f} {ratio:7.2f}x {row['seconds']:8.2f} {rate:8.1f}{note}")


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Ours (S3) against each S3 peer at each size: extra RSS and throughput, ours / peer."""
    got = {(r["side"], r["op"], r["size"]): r for r in rows if "error" not in r}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (side, op, size), other in got.items():
        mine = got.get(("ours-s3", op, size))
        if side not in ("fsspec", "s3tc") or mine is None:
            continue
        cell = out.setdefault(side, {}).setdefault(fmt_size(size), {})
        cell[f"{op}_rss"] = round(mine["extra_bytes"] / max(other["extra_bytes"], 1), 3)
        cell[f"{op}_speed"] = round(other["seconds"] / mine["seconds"], 3)
    return out


def print_ratios(rel: dict[str, dict[str, dict[str, float]]]) -> None:
    print("\ncloudckpt dcp S3 / peer, same run: extra RSS (lower is better), "
          "throughput (higher is better)")
    print(f"  {'peer':<24} {'state':>8} {'RSS save':>9} {'RSS load':>9} "
          f"{'MiB/s save':>11} {'MiB/s load':>11}")
    for peer, by_size in rel.items():
        for size, cell in by_size.items():
            figs = [cell.get(k) for k in ("save_rss", "load_rss", "save_speed", "load_speed")]
            text = [f"{f:.2f}x" if f is not None else "-" for f in figs]
            print(f"  {LABELS[peer]:<24} {size:>8} {text[0]:>9} {text[1]:>9} "
                  f"{text[2]:>11} {text[3]:>11}")


def git_state() -> str:
    """The checkout measured (``--dirty``: figures of uncommitted code)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10, cwd=os.path.dirname(__file__))
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "cloudckpt", "s3torchconnector", "s3fs", "moto"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


def parent(args: argparse.Namespace) -> int:
    if "s3tc" in args.sides and importlib.util.find_spec("s3torchconnector") is None:
        raise SystemExit("s3torchconnector is not installed: `pip install s3torchconnector` "
                         "(not a cloudckpt dependency), or leave s3tc out of --cases")
    local_root = tempfile.mkdtemp(prefix="cloudckpt-memory-bench-", dir=args.local_dir)
    rows: list[dict[str, Any]] = []
    print(f"{args.tensors} float32 tensors per state; extra = peak RSS during the call minus "
          f"RSS before it, fresh child per case; versions {versions()}\n"
          f"  {'case':<24} {'op':<5} {'state':>8} {'extra MiB':>9} {'x state':>8} "
          f"{'seconds':>8} {'MiB/s':>8}", flush=True)
    try:
        with MotoServer() as server:
            server.create_bucket(BUCKET)
            for size in args.size_list:
                for side in args.sides:
                    rows.extend(run_side(args, server, side, size, local_root))
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
    summary = report(args, rows)
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nfigures written to {args.json}")
    return 1 if any("error" in r for r in rows) else 0


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    rel = ratios(rows)
    if rel:
        print_ratios(rel)
    return {
        "git": git_state(),
        "tensors": args.tensors,
        "sizes": args.size_list,
        "threads": THREADS,
        "async_budget_fraction": args.budget,
        "versions": versions(),
        "results": rows,
        "ratios": rel,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Single process on purpose (no process group): silence DCP's notice about it.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.child:
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
