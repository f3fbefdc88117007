"""``cloudckpt cp`` and ``cloudckpt download`` versus plain s3fs/gcsfs on the same objects.

Measures, in one run against a moto server (and a fake-gcs-server) it starts
itself, on one committed checkpoint of ``--objects`` objects of ``--size-mib``
each (default 4 x 256 MiB = 1 GiB):

* ``cp`` S3 -> S3: :func:`cloudckpt.movement.checkpoint_copy.copy_checkpoint` to a new prefix
  of the same bucket (server-side copies, each checked by the CRC32C S3
  reports) versus s3fs ``fs.copy(src_paths, dst_paths)`` of the same objects;
* ``download`` S3 -> local: ``copy_checkpoint`` to a local directory (parallel
  ranged GETs written into place, checked, fsynced and renamed, as
  ``cloudckpt download`` does) versus s3fs ``fs.get(src_paths, dir)``;
* ``cp`` GCS -> GCS on fake-gcs-server: ``copy_checkpoint`` (rewrite) versus
  gcsfs ``fs.copy`` (skip with ``--no-gcs``).

Every timed run is one fresh child process, so that no side reuses heap
another one freed: it sets up its client, sends one small request (untimed),
then times the operation while sampling its resident set every 5 ms. Peak RSS
is shown above that baseline. Each repetition runs both sides of each
operation, alternating which goes first; the best and the median of
``--repeat`` are shown, and the ratio (ours / baseline throughput, target >=
0.9) is of the best. What each side produced is checked after its timed run
(sizes always, CRC32C of every object on the first repetition for copies and
on every one for downloads), so a failing side cannot pass for a fast one. The
CPU seconds the server spent are shown per run: on a 2-core machine the server
is often the bottleneck, and what a side asks of it is the cost.

Usage::

    python benchmarks/transfer_bench.py [--objects 4] [--size-mib 256] [--repeat 2]
                                        [--no-gcs] [--local-dir DIR]

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import google_crc32c  # noqa: E402
from memory import RssSampler  # noqa: E402 - benchmarks/memory.py, beside this script

#: Acceptance target: ours / baseline throughput.
TARGET_RATIO = 0.9
MB = 1_000_000
BUCKET = "cloudckpt-transfer-bench"
SRC = "src/step-1"
KEY = SECRET = "testing"
OPS = ("cp_s3", "download_s3", "cp_gcs")
LABEL = {"cp_s3": ("cp S3->S3", "s3fs fs.copy"),
         "download_s3": ("download S3->local", "s3fs fs.get"),
         "cp_gcs": ("cp GCS->GCS", "gcsfs fs.copy")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=4, help="objects (default 4)")
    p.add_argument("--size-mib", type=float, default=256.0, help="MiB per object (default 256)")
    p.add_argument("--repeat", type=int, default=2, help="repetitions per side (default 2)")
    p.add_argument("--no-gcs", action="store_true", help="skip GCS -> GCS on fake-gcs-server")
    p.add_argument("--local-dir", default=None, help="where downloads go (default: a temp dir)")
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one timed run
    args = p.parse_args(argv)
    if args.objects < 1 or args.size_mib <= 0 or args.repeat < 1:
        p.error("--objects, --size-mib and --repeat must be positive")
    return args


# ------------------------------------------------------------ one run (child)


def crc_of_file(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while data := f.read(8 << 20):
            crc = google_crc32c.extend(crc, data)
    return f"{crc:08x}"


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One timed run described by ``spec``; what it measured, as a dict."""
    import cloudckpt
    from cloudckpt.movement.checkpoint_copy import copy_checkpoint

    op, side, dst, check = spec["op"], spec["side"], spec["dst"], spec["check"]
    s3 = spec["op"] != "cp_gcs"
    opts = spec["s3_options"] if s3 else spec["gcs_options"]
    scheme = "s3" if s3 else "gs"
    names: list[str] = spec["names"]
    src_paths = [f"{BUCKET}/{SRC}/{n}" for n in names]
    if side == "ours":
        src = cloudckpt.open_checkpoint(f"{scheme}://{BUCKET}/{SRC}", opts)
        src.store.info(names[0])  # connections up, untimed
        target = dst if op == "download_s3" else f"{scheme}://{BUCKET}/{dst}"
        dst_options = None if op == "download_s3" else opts  # as `cloudckpt download`

        def work() -> Any:
            return copy_checkpoint(src, target, dst_options=dst_options)
    else:
        if s3:
            import s3fs

            fs: Any = s3fs.S3FileSystem(endpoint_url=opts["endpoint_url"], key=KEY,
                                        secret=SECRET, skip_instance_cache=True)
        else:
            import gcsfs

            fs = gcsfs.GCSFileSystem(endpoint_url=opts["endpoint_url"], token="anon",
                                     skip_instance_cache=True)
        fs.info(src_paths[0])  # connections up, untimed
        fs.invalidate_cache()
        if op == "download_s3":
            os.makedirs(dst, exist_ok=True)

            def work() -> Any:
                return fs.get(src_paths, dst + "/")
        else:
            def work() -> Any:
                return fs.copy(src_paths, [f"{BUCKET}/{dst}/{n}" for n in names])
    with RssSampler() as rss:
        t0 = time.perf_counter()
        work()
        secs = time.perf_counter() - t0
    # What was produced: every object's size, and its CRC32C when asked to.
    want = spec["crcs"]
    for n in names:
        if op == "download_s3":
            path = os.path.join(dst, n)
            size = os.path.getsize(path)
            crc = crc_of_file(path) if check else None
        else:
            store = cloudckpt.open_store(f"{scheme}://{BUCKET}/{dst}", opts)
            size = store.size(n)
            crc = f"{google_crc32c.value(store.get(n)):08x}" if check else None
        if size != spec["size"] or (crc is not None and crc != want[n]):
            raise SystemExit(f"FAIL {op} {side}: {n} has {size} bytes, crc32c {crc}")
    return {"secs": secs, "rss_above": rss.peak - rss.baseline, "rss_peak": rss.peak}


# ------------------------------------------------------------ orchestration


def proc_cpu(pid: int) -> float:
    """CPU seconds used so far by process ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_source(uri: str, options: dict[str, Any], names: list[str], size: int
                ) -> dict[str, str]:
    """A committed checkpoint of random objects at ``uri``; their CRC32Cs."""
    from cloudckpt import CheckpointWriter

    with CheckpointWriter(uri, step=1, storage_options=options) as w:
        for n in names:
            with w.open(n) as f:
                left = size
                while left:
                    piece = os.urandom(min(left, 16 << 20))
                    f.write(piece)
                    left -= len(piece)
    return {n: e.crc32c for n, e in w.entries.items()}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--run", json.dumps(spec)],
                         capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(f"FAIL {spec['op']} {spec['side']}:\n{out.stdout[-2000:]}"
                         f"{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run:
        print(json.dumps(run_one(json.loads(args.run))))
        return 0

    from cloudckpt_testkit import FakeGcsServer, MotoServer

    import cloudckpt

    size = int(args.size_mib * 1024 * 1024)
    total = size * args.objects
    names = [f"obj-{i:03d}.bin" for i in range(args.objects)]
    ops = [op for op in OPS if not (args.no_gcs and op == "cp_gcs")]
    moto = MotoServer()
    gcs = None if args.no_gcs else FakeGcsServer()
    local = tempfile.mkdtemp(prefix="cloudckpt-transfer-bench-", dir=args.local_dir)
    try:
        moto.start()
        moto.create_bucket(BUCKET)
        s3_opts = moto.storage_options()
        gcs_opts: dict[str, Any] = {}
        pids = {"cp_s3": moto._proc.pid, "download_s3": moto._proc.pid}  # type: ignore[union-attr]
        if gcs is not None:
            gcs.start()
            gcs.create_bucket(BUCKET)
            gcs_opts = gcs.storage_options()
            pids["cp_gcs"] = gcs._proc.pid  # type: ignore[union-attr]
        print(f"writing the source checkpoint: {args.objects} x {args.size_mib:g} MiB "
              f"({total / MB:.0f} MB) ...", flush=True)
        crcs = make_source(f"s3://{BUCKET}/{SRC}", s3_opts, names, size)
        if gcs is not None:
            gcs_crcs = make_source(f"gs://{BUCKET}/{SRC}", gcs_opts, names, size)
            assert gcs_crcs.keys() == crcs.keys()
        stores = {"s3": cloudckpt.open_store(f"s3://{BUCKET}", s3_opts)}
        if gcs is not None:
            stores["gs"] = cloudckpt.open_store(f"gs://{BUCKET}", gcs_opts)

        results: dict[str, list[dict[str, Any]]] = {}
        print(f"\n{'rep':>3}  {'operation':<20} {'side':<5} {'s':>7} {'MB/s':>8} "
              f"{'RSS+ MiB':>9} {'server CPU s':>12}", flush=True)
        for rep in range(args.repeat):
            order = ("ours", "base") if rep % 2 == 0 else ("base", "ours")
            for op in ops:
                for side in order:
                    dst = (os.path.join(local, f"{side}-{rep}") if op == "download_s3"
                           else f"dst/{op}-{side}-{rep}")
                    spec = {"op": op, "side": side, "dst": dst, "names": names, "size": size,
                            "crcs": crcs if op != "cp_gcs" else gcs_crcs,
                            "check": rep == 0 or op == "download_s3",
                            "s3_options": s3_opts, "gcs_options": gcs_opts}
                    c0 = proc_cpu(pids[op])
                    r = child(spec)
                    r["server_cpu"] = proc_cpu(pids[op]) - c0
                    results.setdefault(f"{op}:{side}", []).append(r)
                    print(f"{rep:>3}  {LABEL[op][0]:<20} {side:<5} {r['secs']:>7.2f} "
                          f"{total / r['secs'] / MB:>8.1f} {r['rss_above'] / 2**20:>9.0f} "
                          f"{r['server_cpu']:>12.2f}", flush=True)
                    if op == "download_s3":
                        shutil.rmtree(dst, ignore_errors=True)
                    else:
                        stores["s3" if op != "cp_gcs" else "gs"].child(dst).delete_prefix("")
        summary = report(results, ops, total, args)
    finally:
        shutil.rmtree(local, ignore_errors=True)
        moto.stop()
        if gcs is not None:
            gcs.stop()
    print(json.dumps(summary))
    return 0


def report(results: dict[str, list[dict[str, Any]]], ops: list[str], total: int,
           args: argparse.Namespace) -> dict[str, Any]:
    best: Callable[[str], dict[str, Any]] = lambda k: min(results[k], key=lambda r: r["secs"])  # noqa: E731
    med: Callable[[str], float] = lambda k: statistics.median(r["secs"] for r in results[k])  # noqa: E731
    print(f"\n{args.objects} x {args.size_mib:g} MiB = {total / MB:.0f} MB; best (median) of "
          f"{args.repeat}; MB = 10^6 bytes; RSS = peak resident set above the run's baseline")
    print("| operation | side | seconds | MB/s | peak RSS | server CPU s | ratio |")
    print("|---|---|---|---|---|---|---|")
    summary: dict[str, Any] = {"objects": args.objects, "size_mib": args.size_mib,
                               "repeat": args.repeat, "target": TARGET_RATIO}
    for op in ops:
        ours, base = best(f"{op}:ours"), best(f"{op}:base")
        ratio = base["secs"] / ours["secs"]
        for side, r, name in (("ours", ours, "cloudckpt"), ("base", base, LABEL[op][1])):
            print(f"| {LABEL[op][0]} | {name} | {r['secs']:.2f} ({med(f'{op}:{side}'):.2f}) | "
                  f"{total / r['secs'] / MB:.0f} | {r['rss_above'] / 2**20:.0f} MiB | "
                  f"{r['server_cpu']:.1f} | "
                  f"{f'**{ratio:.2f}x**' if side == 'ours' else ''} |")
        summary[op] = {"ratio": round(ratio, 3),
                       "ours_s": round(ours["secs"], 3), "base_s": round(base["secs"], 3),
                       "ours_median_s": round(med(f"{op}:ours"), 3),
                       "base_median_s": round(med(f"{op}:base"), 3),
                       "ours_rss_mib": round(ours["rss_above"] / 2**20, 1),
                       "base_rss_mib": round(base["rss_above"] / 2**20, 1)}
    summary["meets_target"] = all(summary[op]["ratio"] >= TARGET_RATIO for op in ops)
    return summary


if __name__ == "__main__":
    sys.exit(main())
