"""Bit-exact resume from a bucket: SIGKILL a real training run (at a random step,
and mid-save), restart it from the s3:// URI, and compare with a run that never
stopped: the same loss at every step and the same final parameters."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cloudckpt_testkit.nodes import as_node, node_env
from training_runs import explain, launcher, losses, run_and_kill, run_crashing, run_through

from cloudckpt import open_store
from cloudckpt.core.liveness import _whoami
from cloudckpt.names import CLAIM_NAME

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


# ------------------------------------------- a relaunch on another node, by itself


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory) -> tuple[dict[int, str], Path]:
    """An uninterrupted two-rank run (on local disk: the losses do not depend on it)."""
    base = tmp_path_factory.mktemp("reference")
    out = run_through([*launcher(2), EXAMPLE, "--root", str(base / "root"), "--steps",
                       str(STEPS), "--every", str(EVERY), "--out", str(base / "ref.pt")],
                      env(None))
    return losses(out), base / "ref.pt"


def on_node(cmd: list[str], tmp_path: Path, host: str, **extra: str) -> tuple[list[str], dict]:
    """``cmd`` launched as on another node (a new pid namespace, its own hostname and
    local disk), with ``extra`` in its environment."""
    return as_node(cmd, host), node_env(tmp_path, host, {**env(None), **extra})


@pytest.mark.parametrize("relaunch", ["same-run", "claim-elsewhere", "other-run"])
def test_a_save_killed_mid_way_is_saved_again_by_a_relaunch_elsewhere(
        s3, tmp_path, two_rank_reference, relaunch):
    """Two ranks SIGKILLed mid-save of step 5 (its DCP part written, its root manifest
    not), relaunched in a new pid namespace on another "node" (or, with the claim
    rewritten to another host and boot id, here): the relaunch saves step 5 again by
    itself and ends bit-exact with a run that never stopped. A relaunch of the same run
    takes the crashed save's claim over at once; one of another run once its lease ran
    out."""
    reference, ref_params = two_rank_reference
    root = s3.uri("relaunched")
    lease = "600" if relaunch != "other-run" else "8"
    first = {"CLOUDCKPT_RUN_ID": "run-1", "CLOUDCKPT_RUN_ATTEMPT": "0",
             "CLOUDCKPT_CLAIM_LEASE": lease}
    again = {**first, "CLOUDCKPT_RUN_ATTEMPT": "1"}
    if relaunch == "other-run":
        again["CLOUDCKPT_RUN_ID"] = "run-2"
    crash_cmd = command(s3, root, 2, "--crash-mid-save", "5")
    if relaunch == "claim-elsewhere":
        cmd, environ = crash_cmd, {**env(s3), **first}
    else:
        cmd, environ = on_node(crash_cmd, tmp_path, "node-a", **first)
    crash = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300)
    assert "crashing mid-save of step 5" in crash.stdout, explain(crash)
    store = open_store(f"{root}/step-5", s3.options)
    claim = json.loads(store.get(CLAIM_NAME))
    if relaunch == "claim-elsewhere":  # the crashed attempt as seen from another node
        claim.update(host="node-a", boot_id="another-boot", pid=1)
        store.put(CLAIM_NAME, json.dumps(claim).encode())
    else:
        assert claim["host"] == "node-a" and claim["pid_ns"] != _whoami()["pid_ns"]
    assert not store.exists("cloudckpt-manifest.json")

    out = tmp_path / "resumed.pt"
    cmd, environ = on_node(command(s3, root, 2, "--out", str(out)), tmp_path, "node-b", **again)
    started = time.time()
    resumed = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300)
    assert resumed.returncode == 0 and "done" in resumed.stdout, explain(resumed)
    assert "resumed at step 3" in resumed.stdout
    assert_same_run(reference, crash.stdout, resumed.stdout)
    assert_same_params(ref_params, out)
    took_over = [line for line in resumed.stderr.splitlines()
                 if line.startswith(f"taking over {root}/step-5 ")]
    assert len(took_over) == 1, resumed.stderr[-3000:]  # saved again, by itself
    if relaunch == "other-run":  # waited out the crashed save's lease, then took it over
        assert "its lease of 8 s" in took_over[0]
        assert time.time() >= claim["renewed"] + 8
    else:
        assert "an earlier attempt of this run" in took_over[0]
        assert time.time() - started < 120  # not after a 600 s lease
