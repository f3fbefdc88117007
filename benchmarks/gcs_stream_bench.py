"""Streamed GCS writes: cloudckpt's parallel parts + compose versus gcsfs's resumable
upload, against a local fake-gcs-server.

Both sides stream the same bytes in the same pieces (``--piece-mib``) into a
new object, alternating which goes first; the best of ``--repeat`` is kept.
Every object written is read back and compared before it counts. The last
line printed is a JSON summary (``{"stream_ratio": ...}``: ours / gcsfs
throughput). An emulator's speed is not GCS's: the ratio says what the
client side costs, not what a bucket will do.

Usage::

    python benchmarks/gcs_stream_bench.py [--size-mib 256] [--part-mib 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

from cloudckpt_testkit import FakeGcsServer

import cloudckpt

MB = 1_000_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=float, default=256.0, help="object size (default 256)")
    p.add_argument("--part-mib", type=float, default=16.0,
                   help="cloudckpt part_size and gcsfs block_size (default 16)")
    p.add_argument("--piece-mib", type=float, default=4.0, help="write() size (default 4)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; best is kept")
    args = p.parse_args(argv)
    if min(args.size_mib, args.part_mib, args.piece_mib) <= 0 or args.repeat < 1:
        p.error("sizes and --repeat must be positive")
    return args


def stream(write: Callable[[bytes], object], data: bytes, piece: int) -> None:
    view = memoryview(data)
    for i in range(0, len(data), piece):
        write(bytes(view[i:i + piece]))


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    size, part = int(args.size_mib * 2**20), int(args.part_mib * 2**20)
    part -= part % (256 * 1024)  # GCS resumable chunks come in 256 KiB units
    piece = int(args.piece_mib * 2**20)
    data = os.urandom(size)
    with FakeGcsServer() as server:
        server.create_bucket("bench")
        store = cloudckpt.open_store("gs://bench/ours", {**server.storage_options(),
                                                         "part_size": part})
        fs = store.fs

        def ours(i: int) -> str:
            with store.open_write(f"obj-{i}") as w:
                stream(w.write, data, piece)
            return f"bench/ours/obj-{i}"

        def gcsfs_resumable(i: int) -> str:
            path = f"bench/base/obj-{i}"
            with fs.open(path, "wb", block_size=part) as f:
                stream(f.write, data, piece)
            return path

        best = {"cloudckpt": float("inf"), "gcsfs": float("inf")}
        sides = [("cloudckpt", ours), ("gcsfs", gcsfs_resumable)]
        for rep in range(args.repeat):
            for name, fn in sides if rep % 2 == 0 else sides[::-1]:
                t0 = time.perf_counter()
                path = fn(rep)
                took = time.perf_counter() - t0
                if fs.cat_file(path) != data:
                    raise SystemExit(f"{name} wrote something else than it was given")
                best[name] = min(best[name], took)
    mbs = {k: size / MB / v for k, v in best.items()}
    print(f"streamed write of {size / MB:.0f} MB, parts of {part / 2**20:g} MiB, "
          f"best of {args.repeat}:")
    for name, v in mbs.items():
        print(f"  {name:10s} {v:8.1f} MB/s  ({best[name]:.2f} s)")
    summary = {"stream_ratio": round(mbs["cloudckpt"] / mbs["gcsfs"], 2)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
