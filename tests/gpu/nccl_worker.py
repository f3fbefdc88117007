"""One rank of tests/gpu's NCCL test (run by torch.distributed.run): a sharded save of
CUDA tensors to the URI in argv[1], a load into zeros, one JSON line with the result."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import cloudckpt.dcp as cdcp


def main() -> None:
    uri = sys.argv[1]
    options = json.loads(os.environ["CKPT_OPTIONS"])
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    state = {f"rank{rank}": torch.randn(5 * (1 << 20) + rank, device="cuda", generator=g)
             .to(torch.bfloat16),
             "shared": torch.arange(1000, device="cuda", dtype=torch.float32)}
    cdcp.save(state, uri, storage_options=options, process_group=dist.group.WORLD)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    cdcp.load(out, uri, storage_options=options, process_group=dist.group.WORLD)
    torch.cuda.synchronize()
    equal = all(torch.equal(out[k], v) for k, v in state.items())
    print(json.dumps({"rank": rank, "equal": equal}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
