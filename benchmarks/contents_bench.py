"""Looking inside checkpoints without downloading them, counted by a request-logging
proxy in front of moto S3 on 127.0.0.1: bytes and time of ``inspect``, ``diff`` and a
partial load of one tensor out of many, against a plain s3fs download of the same
checkpoint's bytes in the same run, with the peak extra memory of each.

    python benchmarks/contents_bench.py [--size-mib 1024] [--tensors 64]

Targets: inspect of a DCP checkpoint and of a sharded HF export reads <= 1% of the
bytes; diff reads no tensor bytes; loading one tensor of N reads <= 1.2x its bytes
plus the metadata.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from typing import Any

import s3fs
import torch
from _rss import PeakRss  # benchmarks/_rss.py: run as a script, its folder is on the path
from cloudckpt_testkit import FaultProxy, MotoServer

import cloudckpt.dcp as cdcp
from cloudckpt import open_checkpoint
from cloudckpt.contents import diff, list_contents
from cloudckpt.hf import export, load_tensors


def measured(proxy: FaultProxy, fn: Callable[[], Any]) -> tuple[int, int, float, int]:
    """Bytes the proxy relayed, requests, seconds and peak extra memory of ``fn()``."""
    proxy.reset_counters()
    with PeakRss() as mem:
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
    return proxy.bytes_out, proxy.requests, took, mem.above


def row(label: str, got: tuple[int, int, float, int], total: int, base_s: float,
        goal: str) -> None:
    n, reqs, took, mem = got
    print(f"{label:<34} {n / 2**20:>10.3f} {n / total:>9.5f} {reqs:>5} {took:>8.3f} "
          f"{took / base_s:>8.4f} {mem / 2**20:>8.1f}  {goal}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--max-shard-size", default="200MB")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    side = int((args.size_mib * 2**20 // 4 // args.tensors) ** 0.5)
    state = {f"model.layers.{i}.weight": torch.randn(side, side) for i in range(args.tensors)}
    changed = {**state, "model.layers.5.weight": state["model.layers.5.weight"] + 1}
    one = "model.layers.17.weight"
    tensor_bytes = side * side * 4
    with MotoServer() as server, FaultProxy(server.endpoint) as proxy:
        server.create_bucket("bench")
        opts = server.storage_options()
        via = {**opts, "endpoint_url": proxy.endpoint}
        cdcp.save(state, "s3://bench/dcp-a", storage_options=opts)
        cdcp.save(changed, "s3://bench/dcp-b", storage_options=opts)
        export(state, "s3://bench/hf", config={"model_type": "toy"},
               max_shard_size=args.max_shard_size, storage_options=opts)
        dcp_total = open_checkpoint("s3://bench/dcp-a", opts).total_size
        hf = open_checkpoint("s3://bench/hf", opts)
        fs = s3fs.S3FileSystem(**via)

        def plain(prefix: str) -> None:  # the baseline: every byte, as s3fs reads them
            fs.invalidate_cache()
            fs.cat([f"bench/{prefix}/{f}" for f in open_checkpoint(
                f"s3://bench/{prefix}", opts).files])

        base_dcp = measured(proxy, lambda: plain("dcp-a"))
        base_hf = measured(proxy, lambda: plain("hf"))
        print(f"{args.size_mib} MiB in {args.tensors} tensors of {tensor_bytes / 2**20:.2f} MiB;"
              f" HF export in {sum(f.endswith('.safetensors') for f in hf.files)} shards")
        print(f"{'operation':<34} {'MiB read':>10} {'of bytes':>9} {'reqs':>5} {'s':>8} "
              f"{'x plain':>8} {'peak MiB':>8}  goal")
        row("plain s3fs download, DCP", base_dcp, dcp_total, base_dcp[2], "baseline")
        row("plain s3fs download, HF", base_hf, hf.total_size, base_hf[2], "baseline")
        row("inspect DCP", measured(proxy, lambda: list_contents("s3://bench/dcp-a", via)),
            dcp_total, base_dcp[2], "<= 0.01 of bytes")
        row("inspect HF export", measured(proxy, lambda: list_contents("s3://bench/hf", via)),
            hf.total_size, base_hf[2], "<= 0.01 of bytes")
        row("diff DCP a b", measured(proxy, lambda: diff(
            "s3://bench/dcp-a", "s3://bench/dcp-b", storage_options=via)), dcp_total,
            base_dcp[2], "no tensor bytes")
        row("diff --values DCP a b", measured(proxy, lambda: diff(
            "s3://bench/dcp-a", "s3://bench/dcp-b", storage_options=via, values=True)),
            dcp_total, base_dcp[2], "2 tensors + metadata")

        def load_one() -> None:
            cdcp.load({one: torch.empty(side, side)}, "s3://bench/dcp-a", storage_options=via)

        got = measured(proxy, load_one)
        row("dcp.load of 1 tensor", got, dcp_total, base_dcp[2], "<= 1.2x tensor + metadata")
        print(f"{'':<34} {got[0] / tensor_bytes:>10.4f}x the tensor's bytes")
        got = measured(proxy, lambda: load_tensors("s3://bench/hf", [one], via))
        row("hf.load_tensors of 1 tensor", got, hf.total_size, base_hf[2],
            "<= 1.2x tensor + headers")
        print(f"{'':<34} {got[0] / tensor_bytes:>10.4f}x the tensor's bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
