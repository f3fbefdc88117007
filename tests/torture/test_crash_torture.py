"""Crash torture: SIGKILL real writers at random instants, then check from a fresh
process that every visible checkpoint verifies and loads, that no acknowledged
save was lost, and that the newest committed state is the one a resume loads.

Workloads (``crash_worker.py``): immutable commits with retention, the same
with torn prefixes, a recover slot and ``gc`` each round, recover-slot
switches, async saves through ``CheckpointManager``, DCP saves on two
gloo ranks (sometimes one rank is killed first, like a lost node), and
incremental DCP saves with retention beside a ``gc`` loop, both killed. The kill
lands anywhere: uniformly within a window of a few save cycles after start.
Trials reuse each root, so every trial also resumes after the previous kill
and rewrites what that kill left torn. Two trials in three are relaunched as on
another node (a new pid namespace and hostname, ``cloudckpt_testkit.nodes``), where the
earlier trial's pids mean nothing: mostly as the next attempt of the same run (which
takes its claims over at once), every fourth as another run (which waits out their
lease, short here).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import crash_worker as cw
import pytest
from dist_run import free_port
from knobs import scale

#: The claims' lease in every trial: what a relaunch of another run waits out.
LEASE = "2"

# scenario -> (backends, trials in the regular run, under `make torture`, kill window in s);
# trials cycle through the backends in this order.
SCENARIOS: dict[str, tuple[tuple[str, ...], int, int, float]] = {
    "commits": (("file", "s3", "gcs", "azure"), 3, 240, 1.5),
    "gc": (("s3", "gcs", "file", "azure"), 2, 120, 2.5),
    "slot": (("gcs", "azure", "s3", "file"), 3, 120, 2.0),
    "async": (("s3", "file"), 2, 110, 2.5),
    "dcp": (("s3", "file"), 2, 110, 3.0),
    "incremental": (("azure", "s3", "gcs", "file"), 3, 105, 2.5),
}


@dataclass
class Tally:
    trials: int = 0
    kills: int = 0
    mid_operation: int = 0  # kills that landed while a save or delete was running
    on_nodes: int = 0  # kills of a workload relaunched in a new pid namespace
    acked: int = 0  # saves acknowledged over all trials
    failures: list[str] = field(default_factory=list)
    backends: Counter = field(default_factory=Counter)


def _readies(log: str) -> int:
    return sum(k == "ready" for k, _ in cw.read_events(log))


def _wait_ready(log: str, before: int, procs: list[Any], timeout: float = 90.0) -> None:
    """Wait until the workload logged one more "ready" than ``before`` (or died)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _readies(log) > before or any(not p.is_alive() for p in procs):
            return
        time.sleep(0.01)
    raise AssertionError(f"workload never became ready: {cw.read_events(log)[-5:]}")


def _attempt(scenario: str, trial: int) -> tuple[str | None, dict[str, str]]:
    """Where trial ``trial`` runs (a node's name, None: here) and its run's environment."""
    env = {"CLOUDCKPT_CLAIM_LEASE": LEASE, "CLOUDCKPT_RUN_ATTEMPT": str(trial),
           "CLOUDCKPT_RUN_ID": f"{scenario}-{'other' if trial % 12 == 4 else 'run'}"}
    return (None if trial % 3 == 2 else f"node-{trial}"), env


def _run_trial(forks: Any, scenario: str, root: str, opts: dict[str, Any], log: str,
               rng: random.Random, window: float, trial: int) -> list[str]:
    """Start the workload, kill it at a random instant; return problems before the check.

    When one rank is killed before the others (a lost node), the survivors may fail
    on their own: that is what they should do; only the check afterwards counts.
    """
    seed = rng.randrange(2**31)
    node, env = _attempt(scenario, trial)

    def process(workload: str, *args: Any, rank: int = 0) -> Any:
        host = None if node is None else f"{node}-{rank}"
        return forks.Process(target=cw.on_node, args=(host, env, workload, *args))

    if scenario == "dcp":
        port = free_port()
        procs = [process("dcp_rank", r, 2, port, root, opts, log, seed, rank=r)
                 for r in range(2)]
    elif scenario == "slot":
        procs = [process("slot_ops", root, opts, log, seed)]
    elif scenario == "async":
        procs = [process("async_ops", root, opts, log, seed)]
    elif scenario == "incremental":  # the saves and a gc, each killed
        procs = [process("incremental_ops", root, opts, log, seed),
                 process("gc_ops", root, opts, log, seed, rank=1)]
    else:
        procs = [process("store_ops", root, opts, log, seed, scenario == "gc")]
    before = _readies(log)
    errors_before = sum(k == "error" for k, _ in cw.read_events(log))
    for p in procs:
        p.start()
    _wait_ready(log, before, procs)
    time.sleep(rng.uniform(0.0, window))
    lost_node = len(procs) > 1 and rng.random() < 0.3
    if lost_node:  # one node lost first, the rest a bit later
        procs[rng.randrange(len(procs))].kill()
        time.sleep(rng.uniform(0.0, 0.5))
    for p in procs:
        p.kill()
    problems = []
    for p in procs:
        p.join(60)
        if p.exitcode != -signal.SIGKILL and not lost_node:
            problems.append(f"workload exited by itself with {p.exitcode}")
    errors = [json.loads(v) for k, v in cw.read_events(log) if k == "error"]
    if len(errors) > errors_before and not lost_node:
        problems.append(f"workload raised: {errors[-1]}")
    return problems


def _fresh_check(forks: Any, scenario: str, root: str, opts: dict[str, Any],
                 out: str) -> dict[str, Any]:
    p = forks.Process(target=cw.check, args=(scenario, root, opts, out))
    p.start()
    p.join(240)
    if p.exitcode != 0:
        p.kill()
        return {"problems": [f"checker failed with {p.exitcode}"], "visible": [], "latest": None}
    with open(out) as f:
        return json.load(f)


def _mid_operation(scenario: str, events: list[tuple[str, str]]) -> bool:
    """Whether the kill landed while a save, delete or gc was running."""
    if scenario == "async":  # the upload runs in the background until the next save
        return max(cw.steps(events, "start"), default=0) > max(cw.steps(events, "commit"),
                                                             default=0)
    kinds = [k for k, _ in events if k not in ("ready", "error")]
    return bool(kinds) and kinds[-1].startswith("start")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_crash_torture(scenario, forks, request, tmp_path, record):
    backends, fast, full, window = SCENARIOS[scenario]
    trials = scale(fast, full)
    envs = {name: request.getfixturevalue({"file": "local"}.get(name, name))
            for name in backends}
    rng = random.Random(f"{scenario}-{os.environ.get('CLOUDCKPT_TORTURE_SEED', '0')}")
    tally = Tally()
    for i in range(trials):
        name = backends[i % len(backends)]
        backend = envs[name]
        opts = json.loads(backend.options_json())
        # async saves start a fresh run each trial; the rest resume where the kill left them
        root = backend.uri(scenario, f"trial-{i}" if scenario == "async" else "run")
        log = str(tmp_path / f"{name}-{i if scenario == 'async' else 'run'}.log")
        problems = _run_trial(forks, scenario, root, opts, log, rng, window, i)
        events = cw.read_events(log)
        tally.mid_operation += _mid_operation(scenario, events)
        tally.acked += len(cw.steps(events, "commit")) if scenario == "async" else 0
        report = _fresh_check(forks, scenario, root, opts, str(tmp_path / "report.json"))
        problems += cw.judge(scenario, events, report)
        tally.trials += 1
        tally.kills += 2 if scenario == "incremental" else 1
        tally.on_nodes += (2 if scenario == "incremental" else 1) * (_attempt(scenario, i)[0]
                                                                     is not None)
        tally.backends[name] += 1
        tally.failures += [f"trial {i} on {name}: {p}" for p in problems]
    record("crash", f"{scenario} ({', '.join(backends)})", tally.trials, faults=tally.kills,
           failures=len(tally.failures), killed_mid_operation=tally.mid_operation,
           killed_on_other_nodes=tally.on_nodes,
           acked_saves=tally.acked or None,
           backends=dict(tally.backends))
    assert not tally.failures, "\n".join(tally.failures[:10])
    # The kills must have landed inside saves, not only between them.
    if tally.trials >= 10:
        assert tally.mid_operation >= tally.trials // 4, tally
