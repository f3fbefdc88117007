"""What a save costs the training loop on each tier, and how soon it is durable in the
bucket; restore time from the local tier against the bucket. One run, moto S3 on
127.0.0.1, the local tier in ``--local-dir`` (default ``/dev/shm``), best of ``--repeat``.

    python benchmarks/tier_bench.py [--sizes-mib 256 1024] [--tensors 16] [--repeat 3]

Rows, per state size:
- sync bucket save: the loop waits until the checkpoint is committed in the bucket;
- async bucket save: the loop waits for staging to host memory; durable at ``wait()``;
- local-tier save: the loop waits for the local commit; durable in the bucket when its
  drain (every local save drained here) commits;
- restore from the bucket and from the local tier;
- with ``LocalTier(replicas=1)`` on 2 gloo ranks as 2 nodes (each in a pid and UTS
  namespace of its own: :func:`cloudckpt_testkit.nodes.enter_node`), each rank holding
  the state size: the restore after node 2's tier is lost, its rank fetching its step
  from the partner's copy over gloo, against the same job restoring from the bucket
  (the job's time: its slower rank).

Goals: local-tier stall <= 0.25x the sync bucket save; local restore <= 0.5x the bucket
restore; partner restore <= 0.5x the bucket restore.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
from cloudckpt_testkit import MotoServer
from cloudckpt_testkit.nodes import enter_node

from cloudckpt import CheckpointManager, LocalTier, ManagerOptions, StepInfo


def _best(fn: Callable[[int], tuple[float, float]], repeat: int) -> tuple[float, float]:
    """The best (stall, time to durable) of ``repeat`` runs of ``fn(rep)``."""
    runs = [fn(rep) for rep in range(repeat)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def bench(size_mib: int, tensors: int, repeat: int, local_dir: str, opts: dict) -> dict:
    n = size_mib * 1024 * 1024 // 4 // tensors
    state = {f"layer{i}.weight": torch.randn(n) for i in range(tensors)}
    tag = f"{size_mib}m"

    def sync(rep: int) -> tuple[float, float]:
        mgr = CheckpointManager(f"s3://bench/{tag}-sync-{rep}", ManagerOptions(every_steps=1),
                                storage_options=opts)
        t0 = time.perf_counter()
        mgr.save(StepInfo(), state, rng=False)
        took = time.perf_counter() - t0
        mgr.close()
        return took, took

    def async_(rep: int) -> tuple[float, float]:
        mgr = CheckpointManager(f"s3://bench/{tag}-async-{rep}",
                                ManagerOptions(every_steps=1, async_save=True),
                                storage_options=opts)
        t0 = time.perf_counter()
        mgr.save(StepInfo(), state, rng=False)
        stall = time.perf_counter() - t0
        mgr.wait()
        durable = time.perf_counter() - t0
        mgr.close()
        return stall, durable

    def local(rep: int) -> tuple[float, float]:
        tier = LocalTier(f"{local_dir}/{tag}-{rep}", every_steps=1, drain_every=1)
        mgr = CheckpointManager(f"s3://bench/{tag}-local-{rep}", ManagerOptions(local=tier),
                                storage_options=opts)
        t0 = time.perf_counter()
        mgr.save(StepInfo(), state, rng=False)
        stall = time.perf_counter() - t0
        mgr.wait()  # the drain
        durable = time.perf_counter() - t0
        mgr.close()
        return stall, durable

    sync_s, _ = _best(sync, repeat)
    async_stall, async_durable = _best(async_, repeat)
    local_stall, local_durable = _best(local, repeat)

    def restore(from_local: bool) -> float:
        tier = LocalTier(f"{local_dir}/{tag}-0", every_steps=1)
        if not from_local:  # the same drained checkpoint, read from the bucket
            tier = LocalTier(f"{local_dir}/{tag}-none", every_steps=1)
        mgr = CheckpointManager(f"s3://bench/{tag}-local-0", ManagerOptions(local=tier),
                                storage_options=opts)
        check = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        assert mgr.restore(check, rng=False) is not None
        took = time.perf_counter() - t0
        assert all(torch.equal(check[k], state[k]) for k in state), "restored state differs"
        return took

    bucket_restore = min(restore(False) for _ in range(repeat))
    local_restore = min(restore(True) for _ in range(repeat))
    return {"size_mib": size_mib, "sync_s": sync_s, "async_stall_s": async_stall,
            "async_durable_s": async_durable, "local_stall_s": local_stall,
            "local_durable_s": local_durable, "bucket_restore_s": bucket_restore,
            "local_restore_s": local_restore,
            "local_stall_over_sync": local_stall / sync_s,
            "local_restore_over_bucket": local_restore / bucket_restore}


def _partner_rank(rank: int, port: int, size_mib: int, tensors: int, repeat: int,
                  local_dir: str, opts: dict, out: mp.Queue) -> None:
    """One rank of the partner benchmark, on a node of its own (see :func:`partner`)."""
    enter_node(f"bench-node-{rank}")
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    gen = torch.Generator().manual_seed(rank)
    n = size_mib * 1024 * 1024 // 4 // tensors
    state = {f"rank{rank}.layer{i}": torch.randn(n, generator=gen) for i in range(tensors)}
    root, node = f"s3://bench/{size_mib}m-partner", f"{local_dir}/{size_mib}m-node-{rank}"

    def manager(tier_dir: str, replicas: int) -> CheckpointManager:
        return CheckpointManager(root, ManagerOptions(local=LocalTier(
            tier_dir, every_steps=1, drain_every=1, replicas=replicas)), storage_options=opts)

    mgr = manager(node, 1)
    mgr.save(StepInfo(), state, rng=False)  # local, copied to the partner, drained
    mgr.close()

    def restore(tier_dir: str, replicas: int) -> float:
        if rank == 1 and replicas:  # node 2 replaced: its own tier is gone, copies stay
            shutil.rmtree(f"{tier_dir}/rank-00001", ignore_errors=True)
        check = {k: torch.empty_like(v) for k, v in state.items()}
        mgr = manager(tier_dir, replicas)
        dist.barrier()
        t0 = time.perf_counter()
        assert mgr.restore(check, rng=False) is not None
        took = time.perf_counter() - t0
        assert all(torch.equal(check[k], state[k]) for k in state), "restored state differs"
        mgr.close()
        return max(t for t in _gathered(took))

    partner_s = min(restore(node, 1) for _ in range(repeat))
    bucket_s = min(restore(f"{node}-empty", 0) for _ in range(repeat))
    if rank == 0:
        out.put((partner_s, bucket_s))
    dist.destroy_process_group()


def _gathered(value: float) -> list[float]:
    import torch.distributed as dist

    got: list[float] = [0.0, 0.0]
    dist.all_gather_object(got, value)
    return got


def partner(size_mib: int, tensors: int, repeat: int, local_dir: str, opts: dict) -> dict:
    """Restore of a lost node's rank from its partner's copy vs from the bucket."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as sock:  # a port for the ranks' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_partner_rank, args=(r, port, size_mib, tensors, repeat,
                                                     local_dir, opts, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    import queue

    while True:  # a rank that fails ends the benchmark, instead of a wait for its answer
        try:
            partner_s, bucket_s = out.get(timeout=5)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError("a partner benchmark rank failed (its traceback is above)"
                                   ) from None
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"a partner benchmark rank ended with {p.exitcode}")
    return {"size_mib": size_mib, "partner_restore_s": partner_s,
            "bucket_restore_2_ranks_s": bucket_s, "partner_over_bucket": partner_s / bucket_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--local-dir", default="/dev/shm")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    local_dir = tempfile.mkdtemp(prefix="tier-bench-", dir=args.local_dir)
    rows = []
    try:
        with MotoServer() as server:
            server.create_bucket("bench")
            for size in args.sizes_mib:
                rows.append(bench(size, args.tensors, args.repeat, local_dir,
                                  server.storage_options()))
            pairs = [partner(size, args.tensors, args.repeat, local_dir,
                             server.storage_options()) for size in args.sizes_mib]
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    print(f"moto S3 on 127.0.0.1, local tier in {args.local_dir}, {args.tensors} tensors, "
          f"best of {args.repeat}; seconds (stall: the training loop waits; durable: "
          "committed in the bucket)")
    print(f"{'state':>8} {'sync':>7} {'async stall':>12} {'async durable':>14} "
          f"{'local stall':>12} {'local durable':>14} {'restore bucket':>15} "
          f"{'restore local':>14}")
    for r in rows:
        print(f"{r['size_mib']:>5} MiB {r['sync_s']:7.3f} {r['async_stall_s']:12.3f} "
              f"{r['async_durable_s']:14.3f} {r['local_stall_s']:12.3f} "
              f"{r['local_durable_s']:14.3f} {r['bucket_restore_s']:15.3f} "
              f"{r['local_restore_s']:14.3f}")
    for r in rows:
        stall, restore = r["local_stall_over_sync"], r["local_restore_over_bucket"]
        print(f"{r['size_mib']:>5} MiB: local stall / sync = {stall:.3f} (goal <= 0.25) "
              f"[{'ok' if stall <= 0.25 else 'MISSED'}]; local restore / bucket = "
              f"{restore:.3f} (goal <= 0.5) [{'ok' if restore <= 0.5 else 'MISSED'}]")
    print("2 gloo ranks as 2 nodes, each holding the state size; node 2's tier lost; the "
          "job's restore (its slower rank), best of the repeats:")
    for r in pairs:
        ratio = r["partner_over_bucket"]
        print(f"{r['size_mib']:>5} MiB: from the partner {r['partner_restore_s']:.3f} s, from "
              f"the bucket {r['bucket_restore_2_ranks_s']:.3f} s; partner / bucket = "
              f"{ratio:.3f} (goal <= 0.5) [{'ok' if ratio <= 0.5 else 'MISSED'}]")
    print(json.dumps([{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                      for r in rows + pairs]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
