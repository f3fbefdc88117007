"""Claims are leases: a writer that is gone, wherever it ran, blocks a save no longer
than its lease, and a relaunch of the same run does not wait at all.

Every writer that must be judged from elsewhere runs as another "node"
(:mod:`cloudckpt_testkit.nodes`: a new pid namespace with its own hostname), the way a
relaunched job comes back on a cluster; pids there mean nothing to this process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cloudckpt_testkit.nodes import as_node, check_unshare, node_env

from cloudckpt import CheckpointWriter, CommitConflictError, open_checkpoint, open_store
from cloudckpt.errors import ConfigError
from cloudckpt.names import CLAIM_NAME
from cloudckpt.runtime import attempt
from cloudckpt.runtime.attempt import Relation

CHILD = str(Path(__file__).with_name("claim_child.py"))
RUN_ENV = ("CLOUDCKPT_RUN_ID", "CLOUDCKPT_RUN_ATTEMPT", "SLURM_JOB_ID", "SLURM_RESTART_COUNT",
           "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "KUBERNETES_SERVICE_HOST",
           attempt.STARTED_ENV)


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """This process belongs to no run unless a test says so."""
    for name in RUN_ENV:
        monkeypatch.delenv(name, raising=False)


class Node:
    """A writer (tests/claim_child.py) on a node of its own, holding ``uri``."""

    def __init__(self, backend, uri: str, tmp_path: Path, host: str, **env: str) -> None:
        self.go = tmp_path / f"go-{host}"
        base = {k: v for k, v in os.environ.items() if k not in RUN_ENV}
        self.proc = subprocess.Popen(
            as_node([sys.executable, CHILD, uri, backend.options_json(), str(self.go)], host),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=node_env(tmp_path, host, {**base, **backend.env, **env}))
        line = self.proc.stdout.readline()
        assert line == "claimed\n", line + self.proc.stderr.read()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def finish(self) -> str:
        self.go.touch()
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err
        return out


def claim_record(backend, uri: str) -> dict:
    return json.loads(open_store(uri, backend.options).get(CLAIM_NAME))


def save(backend, uri: str, data: bytes = b"B" * 4096) -> float:
    """Save ``uri`` from this process; the seconds it took."""
    start = time.monotonic()
    with CheckpointWriter(uri, storage_options=backend.options, step=1) as w:
        w.put("model.bin", data)
    return time.monotonic() - start


def test_this_machine_can_make_nodes() -> None:
    check_unshare()


def test_a_killed_writer_of_another_run_is_taken_over_once_its_lease_runs_out(
        s3, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDCKPT_CLAIM_LEASE", "4")
    monkeypatch.setenv("CLOUDCKPT_RUN_ID", "run-b")
    uri = s3.uri("run", "step-1")
    node = Node(s3, uri, tmp_path, "node-a", CLOUDCKPT_RUN_ID="run-a",
                CLOUDCKPT_CLAIM_LEASE="4")
    node.kill()
    record = claim_record(s3, uri)
    assert record["host"] == "node-a" and record["pid"] == 1 and record["lease"] == 4
    left = record["renewed"] + 4 - time.time()
    took = save(s3, uri)
    assert took >= left - 0.5, (took, left)  # it waited out what was left of the lease
    assert took < left + 8
    assert open_checkpoint(uri, s3.options).read("model.bin") == b"B" * 4096


def test_a_live_writer_elsewhere_keeps_its_claim_and_commits(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDCKPT_CLAIM_LEASE", "6")
    uri = s3.uri("run", "step-1")
    node = Node(s3, uri, tmp_path, "node-a", CLOUDCKPT_CLAIM_LEASE="6")
    time.sleep(2)  # past its first renewal, at a quarter of the lease
    first = claim_record(s3, uri)
    assert first["renewed"] > first["since"]
    start = time.monotonic()
    with pytest.raises(CommitConflictError, match="node-a.*renewed its claim"):
        save(s3, uri)
    assert time.monotonic() - start < 6 + 6  # refused within the lease, not after it
    assert node.finish() == "committed\n"
    ckpt = open_checkpoint(uri, s3.options)
    assert ckpt.read("model.bin") == b"Z" * 4096 and ckpt.read("extra.bin") == b"zombie"


@pytest.mark.parametrize("relaunch", [
    {"CLOUDCKPT_RUN_ID": "run-x", "CLOUDCKPT_RUN_ATTEMPT": "1"},
    {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"},
    {"TORCHELASTIC_RUN_ID": "job-7", "TORCHELASTIC_RESTART_COUNT": "3"},
], ids=["cloudckpt", "slurm", "torchrun"])
def test_a_relaunch_of_the_same_run_takes_over_at_once(s3, tmp_path, monkeypatch, relaunch):
    first = {k: "0" if k.endswith(("ATTEMPT", "COUNT")) else v for k, v in relaunch.items()}
    monkeypatch.setenv("CLOUDCKPT_CLAIM_LEASE", "600")
    for name, value in relaunch.items():
        monkeypatch.setenv(name, value)
    uri = s3.uri("run", "step-1")
    Node(s3, uri, tmp_path, "node-a", CLOUDCKPT_CLAIM_LEASE="600", **first).kill()
    assert save(s3, uri) < 30  # not 600 s
    assert open_checkpoint(uri, s3.options).read("model.bin") == b"B" * 4096


def test_attempts_launched_by_cloudckpt_run_are_ordered_by_their_start(
        s3, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDCKPT_CLAIM_LEASE", "600")
    monkeypatch.setenv("CLOUDCKPT_RUN_ID", "run-x")
    uri = s3.uri("run", "step-1")
    earlier = repr(time.time() - 60)
    Node(s3, uri, tmp_path, "node-a", CLOUDCKPT_CLAIM_LEASE="600", CLOUDCKPT_RUN_ID="run-x",
         **{attempt.STARTED_ENV: earlier}).kill()
    monkeypatch.setenv(attempt.STARTED_ENV, repr(time.time()))
    assert save(s3, uri) < 30  # not its 600 s lease


def test_the_zombie_a_relaunch_replaced_cannot_change_what_it_committed(
        s3, tmp_path, monkeypatch, caplog):
    """The crashed attempt's writer still runs (a partitioned node): the relaunch takes
    its claim over at once and commits; the zombie writes every name again and tries
    to commit. The checkpoint holds the relaunch's bytes only."""
    monkeypatch.setenv("CLOUDCKPT_CLAIM_LEASE", "600")
    monkeypatch.setenv("CLOUDCKPT_RUN_ID", "run-x")
    monkeypatch.setenv("CLOUDCKPT_RUN_ATTEMPT", "1")
    uri = s3.uri("run", "step-1")
    zombie = Node(s3, uri, tmp_path, "node-a", CLOUDCKPT_CLAIM_LEASE="600",
                  CLOUDCKPT_RUN_ID="run-x", CLOUDCKPT_RUN_ATTEMPT="0")
    with caplog.at_level(logging.WARNING, "cloudckpt"):
        assert save(s3, uri) < 30  # not its 600 s lease
    assert "an earlier attempt of this run" in caplog.text
    committed = open_checkpoint(uri, s3.options).manifest.commit_id
    assert zombie.finish().startswith("conflict: this save")
    ckpt = open_checkpoint(uri, s3.options)
    assert ckpt.manifest.commit_id == committed and ckpt.files == ["model.bin"]
    ckpt.verify(deep=True)
    assert ckpt.read("model.bin") == b"B" * 4096


def test_an_attempt_that_was_replaced_does_not_take_its_successors_claim(
        s3, monkeypatch):
    uri = s3.uri("run", "step-1")
    store = open_store(uri, s3.options)
    store.put(CLAIM_NAME, json.dumps({"writer": "w", "host": "node-b", "pid": 1, "run": "r",
                                      "attempt": 5, "since": 0, "renewed": 0}).encode())
    monkeypatch.setenv("CLOUDCKPT_RUN_ID", "r")
    monkeypatch.setenv("CLOUDCKPT_RUN_ATTEMPT", "4")
    with pytest.raises(CommitConflictError, match="later attempt.*replaced"):
        save(s3, uri)
    assert [o.key for o in store.list(internal=True)] == [CLAIM_NAME]


def test_a_held_claim_is_renewed_and_a_committed_one_is_gone(s3, monkeypatch, caplog):
    monkeypatch.setenv("CLOUDCKPT_CLAIM_LEASE", "1")
    uri = s3.uri("run", "step-1")
    store = open_store(uri, s3.options)
    with caplog.at_level(logging.WARNING, "cloudckpt"):
        with CheckpointWriter(uri, storage_options=s3.options) as w:
            w.put("a.bin", b"a")
            first, v1 = store.get_with_version(CLAIM_NAME)
            time.sleep(1.2)
            later, v2 = store.get_with_version(CLAIM_NAME)
        time.sleep(0.6)  # a renewal would have fallen due by now
    assert v1 != v2 and json.loads(later)["renewed"] > json.loads(first)["renewed"]
    assert json.loads(later)["since"] == json.loads(first)["since"]
    assert not store.exists(CLAIM_NAME)
    assert caplog.text == ""  # no renewal raced the release


def test_a_bad_lease_setting_is_refused(s3, monkeypatch):
    for bad in ("0", "soon", "1e9"):
        monkeypatch.setenv("CLOUDCKPT_CLAIM_LEASE", bad)
        with pytest.raises(ConfigError, match="CLOUDCKPT_CLAIM_LEASE"):
            CheckpointWriter(s3.uri("x"), storage_options=s3.options)


@pytest.mark.parametrize(("env", "run", "number"), [
    ({}, None, None),
    ({"CLOUDCKPT_RUN_ID": "a", "SLURM_JOB_ID": "9"}, "a", None),
    ({"SLURM_JOB_ID": "9"}, "slurm:9", 0),
    ({"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "2"}, "slurm:9", 2),
    ({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "1"}, None, None),
    ({"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_RESTART_COUNT": "1"}, "torchelastic:j", 1),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "trainer-0"}, "k8s-pod:trainer-0",
     None),
])
def test_the_run_and_attempt_come_from_the_launcher(env, run, number):
    me = attempt.current(env)
    assert (me.run, me.number) == (run, number)


def test_attempts_are_ordered_by_number_then_by_start():
    me = attempt.Attempt("r", 2, 1000.0)
    assert me.relation({"run": "r", "attempt": 1}) is Relation.EARLIER
    assert me.relation({"run": "r", "attempt": 3}) is Relation.LATER
    assert me.relation({"run": "r", "attempt": 2, "attempt_started": 1.0}) is Relation.SAME
    assert me.relation({"run": "other", "attempt": 1}) is Relation.UNRELATED
    plain = attempt.Attempt("r", None, 1000.0)
    assert plain.relation({"run": "r", "attempt_started": 900.0}) is Relation.EARLIER
    assert plain.relation({"run": "r", "attempt_started": 1100.0}) is Relation.LATER
    assert plain.relation({"run": "r", "attempt_started": 1000.5}) is Relation.UNRELATED
    assert plain.relation({"run": "r", "attempt_started": 1000.0}) is Relation.SAME
    assert attempt.Attempt(None, None, 1.0).relation({"run": None}) is Relation.UNRELATED
    unknown = attempt.Attempt("r", None, None)  # neither a number nor a launcher's start
    assert unknown.relation({"run": "r", "attempt_started": 900.0}) is Relation.UNRELATED
    assert unknown.relation({"run": "r", "attempt": 1}) is Relation.UNRELATED


def test_cloudckpt_run_makes_its_processes_one_attempt_of_the_run():
    """Every process one ``cloudckpt run`` starts shares the attempt's start; a second
    launch with the same ``--run-id`` is a later attempt of the same run."""
    show = ("import json, os; from cloudckpt.runtime import attempt; "
            "print(json.dumps(attempt.current().record()))")
    launch = [sys.executable, "-m", "cloudckpt", "run", "--run-id", "job-1", "--", "sh",
              "-c", '"$0" -c "$1"; "$0" -c "$1"', sys.executable, show]
    env = {k: v for k, v in os.environ.items() if k not in RUN_ENV}

    def launched() -> list[str]:
        return subprocess.run(launch, capture_output=True, text=True, check=True, env=env,
                              timeout=120).stdout.splitlines()

    first = launched()
    time.sleep(2.5)  # more than two machines' clocks may differ by
    again = launched()
    a, b = (json.loads(line) for line in first)
    assert a == b and a["run"] == "job-1"  # one attempt: same run, same start
    later = attempt.Attempt("job-1", None, json.loads(again[0])["attempt_started"])
    assert later.relation(a) is Relation.EARLIER


def test_a_relaunch_takes_over_from_its_earlier_attempt_still_running_on_this_host(
        s3, tmp_path, monkeypatch):
    """The crashed attempt's process may still run (hung) on the same host: an earlier
    attempt of this run is replaced all the same; it cannot commit."""
    monkeypatch.setenv("CLOUDCKPT_CLAIM_LEASE", "600")
    monkeypatch.setenv("CLOUDCKPT_RUN_ID", "run-x")
    monkeypatch.setenv("CLOUDCKPT_RUN_ATTEMPT", "1")
    uri = s3.uri("run", "step-1")
    go = tmp_path / "go"
    hung = subprocess.Popen(
        [sys.executable, CHILD, uri, s3.options_json(), str(go)], stdout=subprocess.PIPE,
        text=True, env={**os.environ, **s3.env, "CLOUDCKPT_RUN_ATTEMPT": "0"})
    assert hung.stdout.readline() == "claimed\n"
    assert save(s3, uri) < 30  # not its 600 s lease
    go.touch()
    out, _ = hung.communicate(timeout=60)
    assert out.startswith("conflict: this save")
    assert open_checkpoint(uri, s3.options).read("model.bin") == b"B" * 4096
