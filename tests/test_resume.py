"""Bit-exact resume from a bucket: SIGKILL a real training run (at a random step,
and mid-save), restart it from the s3:// URI, and compare with a run that never
stopped: the same loss at every step and the same final parameters."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from training_runs import launcher, losses, run_and_kill, run_crashing, run_through

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "train_resume.py")
STEPS, EVERY = 16, 3


def command(backend, root: str, ranks: int, *extra: str) -> list[str]:
    return [*launcher(ranks), EXAMPLE, "--root", root, "--storage-options", backend.options_json(),
            "--steps", str(STEPS), "--every", str(EVERY), *extra]


def env(backend) -> dict:
    # PYTHONFAULTHANDLER: a rank that aborts (a rare SIGABRT at exit, after "done")
    # prints every thread's stack, which says who held what then.
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}


def run_to_end(backend, root: str, ranks: int, out: Path, *extra: str) -> str:
    return run_through(command(backend, root, ranks, "--out", str(out), *extra), env(backend))


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
    first = run_and_kill(command(s3, s3.uri("random-kill"), ranks, *async_flag), env(s3),
                         kill_at)
    second = run_to_end(s3, s3.uri("random-kill"), ranks, tmp_path / "a.pt", *async_flag)
    assert "resumed at step" in second
    assert_same_run(reference, first, second)
    assert_same_params(tmp_path / "ref.pt", tmp_path / "a.pt")

    # 2. killed in the middle of a save (DCP part written, root manifest not)
    crash = run_crashing(command(s3, s3.uri("mid-save"), ranks, "--crash-mid-save", "5"),
                         env(s3), "crashing mid-save of step 5")
    resumed = run_to_end(s3, s3.uri("mid-save"), ranks, tmp_path / "b.pt")
    assert "resumed at step 3" in resumed  # the torn step-5 was skipped
    assert_same_run(reference, crash, resumed)
    assert_same_params(tmp_path / "ref.pt", tmp_path / "b.pt")
