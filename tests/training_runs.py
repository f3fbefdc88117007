"""Real training runs for the resume tests: launch, SIGKILL at a step, read losses.

Training scripts print ``step N loss <float.hex()>`` per step (rank 0), so runs
compare exactly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dist_run import free_port


def launcher(ranks: int) -> list[str]:
    """The command prefix running a script on ``ranks`` gloo ranks (torchrun when > 1)."""
    cmd = [sys.executable]
    if ranks > 1:
        cmd += ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    return cmd


def losses(output: str) -> dict[int, str]:
    """``{step: loss}`` from a run's stdout."""
    return {int(line.split()[1]): line.split()[3] for line in output.splitlines()
            if line.startswith("step ") and " loss " in line}


def explain(proc: subprocess.CompletedProcess) -> str:
    """What a failed run said: its last stdout lines and its stderr without torchrun's
    own report, which otherwise fills the tail and hides the worker's traceback."""
    ours = [line for line in proc.stderr.splitlines()
            if "torch/distributed/elastic" not in line and "torch/distributed/run.py" not in line
            and "torch/distributed/launcher" not in line]
    out = proc.stdout.splitlines()[-10:]
    return "\n".join([f"exit {proc.returncode}; stdout ends:", *out, "stderr:", *ours])[-6000:]


def run_through(cmd: list[str], env: dict) -> str:
    """Run a training command to its end (it must succeed and say ``done``); its stdout."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "done" in proc.stdout
    return proc.stdout


def run_crashing(cmd: list[str], env: dict, says: str) -> str:
    """Run a training command that crashes on purpose, saying ``says``; its stdout."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0 and says in proc.stdout, explain(proc)
    return proc.stdout


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


def run_and_kill(cmd: list[str], env: dict, kill_at_step: int,
                 until: Callable[[], bool] | None = None) -> str:
    """Start a run and SIGKILL every process of it once it has printed ``kill_at_step``
    (and, with ``until``, once ``until()`` holds too: e.g. a save has committed, however
    slow the machine). Returns what it printed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, start_new_session=True)
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"step {kill_at_step} "):
            deadline = time.monotonic() + 60
            while until is not None and not until() and time.monotonic() < deadline:
                time.sleep(0.05)
            kill_tree(proc.pid)
            break
    proc.wait(timeout=60)
    assert f"step {kill_at_step} " in "".join(seen), "".join(seen)
    return "".join(seen)
