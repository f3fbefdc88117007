"""Crash torture through the frameworks' own save paths under activation: ROLL's parts,
RLinf's step, AReaL's recover dump, verl's step (framework_workers.py), each SIGKILLed
at a random instant, then checked from a fresh process with the framework's own resume: every
acknowledged save is visible, nothing unsaved is, and the resume loads the newest
committed state, bit-exact. Trials reuse the root, so each also resumes after the
previous kill, two in three as on another node (a new pid namespace and hostname), as
the next attempt of the same run or, every fourth, as another run that waits out the
killed save's lease. A few trials in ``make compat``; at full scale (``make torture``,
``CLOUDCKPT_TORTURE=full``) at least 100 per framework. verl's save is also killed at
chosen points of a step: mid-upload, before its commit, between the commit and the
tracker.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from crash_worker import judge, read_events  # tests/torture, on sys.path through conftest
from forked import forkserver, in_child, in_node, run_child
from knobs import FULL, scale

from cloudckpt.errors import ConfigError
from cloudckpt.hf.hub import push_to_hub

# framework -> (trials in make compat, under make torture, kill window in s: a few saves)
SCENARIOS = {"roll": (1, 110, 3.0), "rlinf": (1, 110, 6.0), "areal": (1, 110, 4.0),
             "verl": (1, 110, 4.0)}


@pytest.fixture(scope="module")
def forks():
    """A forkserver that imported the frameworks once, with cloudckpt activated."""
    return forkserver()


def _count(log: str, kind: str) -> int:
    return sum(k == kind for k, _ in read_events(log))


def _attempt(framework: str, trial: int, env: dict) -> tuple[str | None, dict]:
    """Where trial ``trial`` runs (a node's name, None: here) and its environment: the
    run, the attempt, a short lease (what a relaunch of another run waits out)."""
    run = f"{framework}-{'other' if trial % 12 == 4 else 'run'}"
    return (None if trial % 3 == 2 else f"node-{trial}"), {
        **env, "CLOUDCKPT_CLAIM_LEASE": "2", "CLOUDCKPT_RUN_ID": run,
        "CLOUDCKPT_RUN_ATTEMPT": str(trial)}


def _trial(forks, framework: str, root: str, opts: dict, env: dict, log: str,
           rng: random.Random, window: float, trial: int) -> list[str]:
    # At full scale the kill lands anywhere from the start; a short run waits for one
    # acknowledged save first, so that its one trial always checks a resume.
    kind = "ready" if FULL else "commit"
    seen = _count(log, kind)
    node, env = _attempt(framework, trial, env)
    proc = forks.Process(target=in_node, args=(node, f"{framework}_ops", root, opts, env, log,
                                               rng.randrange(2**31)))
    proc.start()
    deadline = time.monotonic() + 120
    while _count(log, kind) == seen:
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            return [f"no {kind} event from the workload: {read_events(log)[-3:]}"]
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, window))
    proc.kill()
    proc.join(60)
    problems = [] if proc.exitcode == -signal.SIGKILL else [
        f"workload exited by itself with {proc.exitcode}"]
    errors = [v for k, v in read_events(log) if k == "error"]
    return problems + ([f"workload raised: {json.loads(errors[-1])}"] if errors else [])


def _check(forks, framework: str, root: str, opts: dict, env: dict, out: str) -> dict:
    proc = forks.Process(target=in_child, args=(f"{framework}_check", root, opts, env, out))
    proc.start()
    proc.join(240)
    if proc.exitcode != 0:
        proc.kill()
        return {"problems": [f"checker failed with {proc.exitcode}"], "visible": [],
                "latest": None}
    return json.loads(Path(out).read_text())


#: Judged as the crash torture judges its own workloads: ROLL's, RLinf's and verl's as
#: immutable commits (nothing deleted), AReaL's recover dump as a slot.
JUDGED_AS = {"roll": "commits", "rlinf": "commits", "areal": "slot", "verl": "commits"}


@pytest.mark.parametrize("framework", list(SCENARIOS))
def test_framework_crash_torture(framework, forks, s3, tmp_path):
    fast, full, window = SCENARIOS[framework]
    trials = scale(fast, full)
    opts = json.loads(s3.options_json())
    root, log = s3.uri(framework), str(tmp_path / "events.log")
    rng = random.Random(f"{framework}-{os.environ.get('CLOUDCKPT_TORTURE_SEED', '0')}")
    failures, mid_save = [], 0
    for i in range(trials):
        problems = _trial(forks, framework, root, opts, s3.env, log, rng, window, i)
        events = read_events(log)
        kinds = [k for k, _ in events if k in ("start", "commit")]
        mid_save += bool(kinds) and kinds[-1] == "start"
        problems += judge(JUDGED_AS[framework], events,
                          _check(forks, framework, root, opts, s3.env,
                                 str(tmp_path / "report.json")))
        failures += [f"trial {i}: {p}" for p in problems]
    acked = sum(k == "commit" for k, _ in read_events(log))
    on_nodes = sum(_attempt(framework, i, {})[0] is not None for i in range(trials))
    row = {"case": f"{framework} own save path, activated (s3)", "trials": trials,
           "kills": trials, "killed_on_other_nodes": on_nodes, "killed_mid_save": mid_save,
           "acked_saves": acked,
           "failures": len(failures)}
    print(json.dumps(row))
    report = os.environ.get("CLOUDCKPT_TORTURE_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps(row) + "\n")
    assert not failures, "\n".join(failures[:10])
    assert acked >= 1, "no save was ever acknowledged: the kills landed too early"
    if FULL:
        assert mid_save >= trials // 4, row  # the kills landed inside saves too


@pytest.mark.parametrize(("point", "async_save"), [("upload", False), ("upload", True),
                                                   ("commit", False), ("tracker", False)])
def test_verl_killed_inside_a_step_resumes_the_newest_committed_one(point, async_save, forks,
                                                                    s3, tmp_path):
    """verl's save of step 3 killed mid-upload (with verl's ``async_save`` too, which on
    FSDP only makes verl skip its tracker), after its last file, or after its commit:
    the tracker is never ahead of a commit, and ``resume_mode: auto`` loads the newest
    committed step bit-exact (model, optimizer, scheduler, RNG, dataloader)."""
    opts = json.loads(s3.options_json())
    root, log = s3.uri("verl-kill"), str(tmp_path / "events.log")
    proc = forks.Process(target=in_child,
                         args=("verl_ops", root, opts, s3.env, log, 0, point, 3, async_save))
    proc.start()
    proc.join(300)
    if proc.exitcode is None:
        proc.kill()
    assert proc.exitcode == -signal.SIGKILL, read_events(log)[-3:]
    events = read_events(log)
    assert [v for k, v in events if k == "commit"] == ["1", "2"]
    assert not [v for k, v in events if k == "error"]
    report = _check(forks, "verl", root, opts, s3.env, str(tmp_path / "report.json"))
    assert not report["problems"], report
    committed = [1, 2, 3] if point == "tracker" else [1, 2]
    assert report["visible"] == committed
    assert report["latest"] == committed[-1]
    assert report["tracker"] == 2  # written after step 2's commit; step 3's never


def test_verl_steps_go_both_ways_between_verls_disk_layout_and_the_bucket(forks, s3,
                                                                         tmp_path):
    """A step verl wrote on disk, uploaded with ``cloudckpt verl upload``, resumes through
    cloudckpt; a step cloudckpt committed, fetched with ``cloudckpt verl download``,
    resumes under verl's own ``find_latest_ckpt_path`` and checkpoint manager."""
    opts = json.loads(s3.options_json())
    out = tmp_path / "report.json"
    proc = forks.Process(target=in_child, args=("verl_roundtrip", s3.uri("verl-both"), opts,
                                                 s3.env, str(out), str(tmp_path)))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0
    report = json.loads(out.read_text())
    assert report["local_tracker"] == "5"
    assert report["upload_rc"] == 0 and report["download_rc"] == 0
    assert report["up"] == {"step": 5, "same": True, "next": [5]}
    assert report["found"] == str(tmp_path / "fetched" / "global_step_6")
    assert report["down"] == {"step": 6, "same": True, "next": [6]}


def test_pickled_code_in_a_verl_step_is_refused_and_never_runs(forks, s3, tmp_path):
    opts = json.loads(s3.options_json())
    out = tmp_path / "report.json"
    assert run_child(forks, "verl_hostile", s3.uri("verl-hostile"), opts, s3.env, str(out),
                     str(tmp_path)) == 0
    report = json.loads(out.read_text())
    assert report["upload_rc"] == 0  # a well-formed torch.save file
    assert report["error"].startswith("CorruptCheckpointError")
    assert "extra_state_world_size_1_rank_0.pt cannot be loaded safely" in report["error"]
    assert report["ran"] is False


def test_a_verl_steps_hf_model_goes_to_the_hub_and_one_without_is_refused(forks, s3,
                                                                          hub_server, tmp_path,
                                                                          monkeypatch):
    """With ``hf_model`` in ``save_contents`` the actor's ``huggingface/`` folder is an HF
    export of its own, which ``cloudckpt push`` verifies and pushes in one commit; a step
    saved without it is refused, naming the setting."""
    from helpers import HUB_TOKEN

    from cloudckpt.cli import main

    root, report_path = s3.uri("verl-hf"), tmp_path / "report.json"
    assert run_child(forks, "verl_hf", root, s3.env, str(report_path)) == 0
    held = json.loads(report_path.read_text())
    assert "actor/huggingface/model.safetensors" in held["1"]
    assert "actor/huggingface/cloudckpt-manifest.json" in held["1"]  # an export of its own
    assert not any(f.endswith(".safetensors") for f in held["2"])
    for name, value in s3.env.items():  # the command finds the endpoint as a user's would
        monkeypatch.setenv(name, value)
    push = ["push", "--endpoint", hub_server.endpoint, "--token", HUB_TOKEN]
    assert main([*push, f"{root}/global_step_1/actor/huggingface", "me/verl-tiny"]) == 0
    files = hub_server.files("me/verl-tiny")
    assert {"config.json", "model.safetensors"} <= set(files)
    assert len(hub_server.commits("me/verl-tiny")) == 2  # the repo's creation, then one push
    for uri, said in [(f"{root}/global_step_1", f"Its HF export is {root}/global_step_1/"
                       "actor/huggingface: push that"),
                      (f"{root}/global_step_2/actor", "It holds no HF export at huggingface/: "
                       "set actor_rollout_ref.actor.checkpoint.save_contents")]:
        with pytest.raises(ConfigError, match="not a Hugging Face export") as err:
            push_to_hub(uri, "me/verl-tiny", token=HUB_TOKEN, endpoint=hub_server.endpoint,
                        storage_options=s3.options)
        assert said in str(err.value)
    assert len(hub_server.commits("me/verl-tiny")) == 2  # nothing more reached the Hub
