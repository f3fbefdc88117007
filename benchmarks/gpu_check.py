"""`make gpu-check`: the GPU staging feature's checks in one run of at most 8 minutes.

1. Always: its CPU tests (the chunked copies and the pinned pool driven by memcpy
   steps, failures injected; saves and loads through them to moto; Ctrl-C while
   copying; exit with a save pending; staging buffers made once).
2. Where ``torch.cuda.is_available()``: ``tests/gpu`` (CUDA tensors saved and loaded
   bit-exact through moto on 127.0.0.1, an async save while training steps run,
   several ranks over NCCL), then ``benchmarks/gpu_bench.py`` (1 and 8 GiB of CUDA
   bf16 against the plain transfer and torch DCP) with what time is left.
   Without CUDA it says that the GPU part was not run, and exits 0 after the CPU part.

Exits non-zero when a step fails or runs out of time. Needs what `make test` needs
(torch, with CUDA for the GPU part; moto, boto3, pytest, pytest-timeout; the test
kit, put on the path here), nothing from the network; s3torchconnector is measured
where it imports. Run from anywhere: ``python benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The whole run's limit, seconds.
LIMIT = 8 * 60
#: Kept back from the benchmark for the report and the servers' shutdown.
MARGIN = 20

CPU_TESTS = [
    "tests/test_devicecopy.py",
    "tests/test_budget.py::test_only_the_first_save_of_a_layout_allocates_staging_buffers",
    "tests/test_interrupts.py::"
    "test_ctrl_c_while_copying_through_the_pinned_pool_is_a_prompt_keyboard_interrupt",
    "tests/test_exit_flush.py::test_an_unawaited_save_through_the_pinned_pool_is_committed_at_exit",
]


def step(name: str, cmd: list[str], deadline: float) -> bool:
    left = deadline - time.monotonic()
    print(f"\n== gpu-check: {name} ({left:.0f} s left)", flush=True)
    if left <= 5:
        print(f"== gpu-check: {name}: NOT RUN, no time left", flush=True)
        return False
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "testkit"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=left).returncode
    except subprocess.TimeoutExpired:
        print(f"== gpu-check: {name}: TIMED OUT", flush=True)
        return False
    print(f"== gpu-check: {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'}", flush=True)
    return rc == 0


def main() -> int:
    import torch

    deadline = time.monotonic() + LIMIT
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0"]
    ok = step("CPU tests", [*pytest, *CPU_TESTS], deadline)
    if not torch.cuda.is_available():
        print("\n== gpu-check: the GPU part was not run (no CUDA device): tests/gpu and "
              "benchmarks/gpu_bench.py need one", flush=True)
        return 0 if ok else 1
    print(f"\n== gpu-check: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}",
          flush=True)
    ok = step("tests/gpu", [*pytest, "tests/gpu"], deadline) and ok
    bench_s = deadline - time.monotonic() - MARGIN
    ok = step("benchmarks/gpu_bench.py", [sys.executable, "benchmarks/gpu_bench.py",
                                          "--deadline-s", f"{max(bench_s - 60, 1):.0f}"],
              deadline - MARGIN) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
