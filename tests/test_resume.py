"""Bit-exact resume from a bucket: SIGKILL a real training run (at a random step,
and mid-save), restart it from the s3:// URI, and compare with a run that never
stopped: the same loss at every step and the same final parameters."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_run import free_port

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "train_resume.py")
STEPS, EVERY = 16, 3


def command(backend, root: str, ranks: int, *extra: str) -> list[str]:
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                     "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    return [*launcher, EXAMPLE, "--root", root, "--storage-options", backend.options_json(),
            "--steps", str(STEPS), "--every", str(EVERY), *extra]


def env(backend) -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(Path(__file__).parent.parent)}


def losses(output: str) -> dict[int, str]:
    out = {}
    for line in output.splitlines():
        if line.startswith("step ") and " loss " in line:
            step, loss = line.split()[1], line.split()[3]
            out[int(step)] = loss
    return out


def run_to_end(backend, root: str, ranks: int, out: Path, *extra: str) -> str:
    proc = subprocess.run(command(backend, root, ranks, "--out", str(out), *extra),
                          capture_output=True, text=True, env=env(backend), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done" in proc.stdout
    return proc.stdout


def run_and_kill(backend, root: str, ranks: int, kill_at_step: int, *extra: str) -> str:
    """Start training and SIGKILL every process of it once it has printed ``kill_at_step``."""
    proc = subprocess.Popen(command(backend, root, ranks, *extra), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env(backend),
                            start_new_session=True)
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"step {kill_at_step} "):
            kill_tree(proc.pid)
            break
    proc.wait(timeout=60)
    assert f"step {kill_at_step} " in "".join(seen), "".join(seen)
    return "".join(seen)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun's workers run in
    sessions of their own, so killing the process group is not enough)."""
    def children(p: int) -> list[int]:
        try:
            text = Path(f"/proc/{p}/task/{p}/children").read_text()
        except OSError:
            return []
        kids = [int(c) for c in text.split()]
        return kids + [g for k in kids for g in children(k)]

    for p in [*children(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_same_run(reference: dict[int, str], *parts: str) -> None:
    merged: dict[int, str] = {}
    for part in parts:
        for step, loss in losses(part).items():
            assert loss == reference[step], f"step {step}: {loss} != {reference[step]}"
            merged[step] = loss
    assert merged == reference


def assert_same_params(a: Path, b: Path) -> None:
    pa, pb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("ranks", [1, 2])
def test_resume_after_sigkill_is_bit_exact(s3, tmp_path, ranks):
    rng = random.Random(ranks)
    async_flag = ("--async-save",) if ranks == 1 else ()
    ref_out = run_to_end(s3, s3.uri("reference"), ranks, tmp_path / "ref.pt", *async_flag)
    reference = losses(ref_out)
    assert sorted(reference) == list(range(STEPS))

    # 1. killed from outside at a random step
    kill_at = rng.randrange(4, STEPS - 2)
    first = run_and_kill(s3, s3.uri("random-kill"), ranks, kill_at, *async_flag)
    second = run_to_end(s3, s3.uri("random-kill"), ranks, tmp_path / "a.pt", *async_flag)
    assert "resumed at step" in second
    assert_same_run(reference, first, second)
    assert_same_params(tmp_path / "ref.pt", tmp_path / "a.pt")

    # 2. killed in the middle of a save (DCP part written, root manifest not)
    crash = subprocess.run(command(s3, s3.uri("mid-save"), ranks, "--crash-mid-save", "5"),
                           capture_output=True, text=True, env=env(s3), timeout=300)
    assert crash.returncode != 0 and "crashing mid-save of step 5" in crash.stdout
    resumed = run_to_end(s3, s3.uri("mid-save"), ranks, tmp_path / "b.pt")
    assert "resumed at step 3" in resumed  # the torn step-5 was skipped
    assert_same_run(reference, crash.stdout, resumed)
    assert_same_params(tmp_path / "ref.pt", tmp_path / "b.pt")
