"""CUDA tensors saved and loaded through moto on 127.0.0.1: bit-exact, through pinned
buffers reused from one save to the next; an async save while training steps run;
several ranks over NCCL (as many as the machine has GPUs, at most 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import cloudckpt.dcp as cdcp
from cloudckpt.dcp import BudgetStager, devicecopy

HERE = Path(__file__).parent
MiB = 1 << 20


def cuda_state(seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    big = torch.randn(1025, 777, device="cuda", generator=g)
    return {"bf16": torch.randn(3 * MiB + 5, device="cuda", generator=g).to(torch.bfloat16),
            "fp32": torch.randn(2 * MiB + 3, device="cuda", generator=g),
            "strided": big.t()[::3],
            "small": torch.randn(17, device="cuda", generator=g),
            "ints": torch.randint(0, 1 << 30, (300_001,), device="cuda", generator=g),
            "empty": torch.empty(0, device="cuda"),
            "cpu": torch.randn(1000),
            "step": 3}


def like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
            for k, v in state.items()}


def assert_equal(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].device == v.device, k
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_cuda_tensors_round_trip_bit_exact_through_reused_pinned_buffers(s3):
    pool = devicecopy.PinnedPool(4 * MiB, 16 * MiB)  # several chunks per tensor
    for step in range(2):
        state = cuda_state(step)
        uri = s3.uri(f"step-{step}")
        cdcp.save(state, uri, storage_options=s3.options, pinned_pool=pool)
        if step == 0:
            made = pool.allocations
            assert made > 0 and pool.held_bytes <= pool.capacity
        else:
            assert pool.allocations == made, "the second save allocated pinned memory"
        out = like(state)
        cdcp.load(out, uri, storage_options=s3.options)
        torch.cuda.synchronize()
        assert_equal(out, state)
    assert pool.out == 0
    pool.close()


def test_the_shared_pool_is_pinned():
    pool = devicecopy.shared_pool()
    buf = pool.acquire()
    try:
        assert buf.is_pinned()
    finally:
        pool.release(buf)


def test_a_cuda_save_writes_what_a_host_copy_writes(s3):
    from cloudckpt.storage import open_store
    state = cuda_state(7)
    cdcp.save(state, s3.uri("gpu"), storage_options=s3.options)
    host = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    cdcp.save(host, s3.uri("host"), storage_options=s3.options)

    def objects(name: str) -> dict:
        store = open_store(s3.uri(name), s3.options)
        return {o.key: store.get(o.key) for o in store.list() if o.key.endswith(".distcp")}

    assert objects("gpu") == objects("host")


def test_async_save_while_training_steps_run(s3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        x = torch.randn(64, 1024, device="cuda")
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    stager = BudgetStager(1 << 30)
    for k in range(2):
        state = {"model": model.state_dict()}
        expected = {n: t.detach().clone() for n, t in state["model"].items()}
        fut = cdcp.async_save(state, s3.uri(f"async-{k}"), storage_options=s3.options,
                              stager=stager)
        for _ in range(5):  # training goes on while the save uploads
            step()
        fut.result(timeout=300)
        assert stager.allocations == 1, "a later save allocated pinned memory again"
        assert stager.pinned_bytes > 0
        out = {"model": {n: torch.zeros_like(t) for n, t in expected.items()}}
        cdcp.load(out, s3.uri(f"async-{k}"), storage_options=s3.options)
        for n, t in expected.items():
            assert torch.equal(out["model"][n], t), n
    stager.close()


def test_several_ranks_over_nccl(s3, tmp_path):
    world = max(1, min(torch.cuda.device_count(), 4))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent),
                                                        str(HERE.parent.parent / "testkit")]),
           "CKPT_OPTIONS": s3.options_json()}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
         "--master-port=29533", str(HERE / "nccl_worker.py"), s3.uri("nccl")],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == world and all(line["equal"] for line in lines), lines
