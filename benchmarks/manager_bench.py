"""How long an async CheckpointManager save blocks the training loop, against a
sync save of the same state, in the same run (moto S3 on 127.0.0.1).

    python benchmarks/manager_bench.py [--size-mib 256] [--tensors 16] [--repeat 3]

Target: async blocking time <= 25% of the sync save time.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
from cloudckpt_testkit import MotoServer

from cloudckpt import CheckpointManager, ManagerOptions, StepInfo


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    n = args.size_mib * 1024 * 1024 // 4 // args.tensors
    state = {f"layer{i}.weight": torch.randn(n) for i in range(args.tensors)}
    size = sum(t.nbytes for t in state.values())

    with MotoServer() as server:
        server.create_bucket("bench")
        opts = server.storage_options()
        sync_times, block_times, total_times = [], [], []
        for rep in range(args.repeat):
            sync = CheckpointManager(f"s3://bench/sync-{rep}", ManagerOptions(every_steps=1),
                                     storage_options=opts)
            t0 = time.perf_counter()
            sync.save(StepInfo(), state, rng=False)
            sync_times.append(time.perf_counter() - t0)
            sync.close()

            mgr = CheckpointManager(f"s3://bench/async-{rep}",
                                    ManagerOptions(every_steps=1, async_save=True),
                                    storage_options=opts)
            t0 = time.perf_counter()
            mgr.save(StepInfo(), state, rng=False)
            block_times.append(time.perf_counter() - t0)
            mgr.wait()
            total_times.append(time.perf_counter() - t0)
            mgr.close()
        check = {k: torch.empty_like(v) for k, v in state.items()}
        CheckpointManager(f"s3://bench/async-{args.repeat - 1}",
                          storage_options=opts).restore(check, rng=False)
        assert all(torch.equal(check[k], state[k]) for k in state), "restored state differs"

    sync_s, block_s, total_s = min(sync_times), min(block_times), min(total_times)
    ratio = block_s / sync_s
    mb = size / 1e6
    print(f"state: {mb:.0f} MB in {args.tensors} tensors, moto S3 on 127.0.0.1, "
          f"best of {args.repeat}")
    print(f"  sync save:               {sync_s:7.3f} s  ({mb / sync_s:6.1f} MB/s)")
    print(f"  async save, blocking:    {block_s:7.3f} s  (staging to host memory)")
    print(f"  async save, to commit:   {total_s:7.3f} s")
    print(f"  blocking / sync = {ratio:.3f}  target <= 0.25  "
          f"[{'ok' if ratio <= 0.25 else 'MISSED'}]")
    print(json.dumps({"size_mb": round(mb, 1), "sync_s": round(sync_s, 3),
                      "async_block_s": round(block_s, 3), "async_total_s": round(total_s, 3),
                      "block_over_sync": round(ratio, 3), "meets_target": ratio <= 0.25}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
