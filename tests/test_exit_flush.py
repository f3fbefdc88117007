"""A background save still running when the process ends is finished, or reported.

Each test runs a real child process (tests/exit_child.py) that starts an async save
and ends without close()/wait(), against moto over HTTP, and checks from the parent
what reached the bucket, what the child printed and its exit status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cloudckpt_testkit import FaultProxy

import cloudckpt.dcp as cdcp
from cloudckpt import open_checkpoint
from cloudckpt.errors import EXIT_CONFLICT, EXIT_INCOMPLETE

HERE = Path(__file__).parent
CHILD = str(HERE / "exit_child.py")


def _expected_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(256, 1024), "b": torch.arange(100.0)}


def _start(how: str, uri: str, options: dict, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, CHILD, how, uri], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "CKPT_OPTIONS": json.dumps(options),
                        "PYTHONPATH": str(HERE.parent), **env})


def _run(how: str, uri: str, options: dict, **env: str) -> tuple[int, str]:
    proc = _start(how, uri, options, **env)
    out, err = proc.communicate(timeout=180)
    assert "saving" in out, err
    return proc.returncode, err


def _options(backend, endpoint: str | None = None) -> dict:
    opts = json.loads(backend.options_json())
    if endpoint:
        opts["endpoint_url"] = endpoint
    return opts


def _loaded(uri: str, options: dict) -> dict[str, torch.Tensor]:
    open_checkpoint(uri, options).verify(deep=True)
    state = {k: torch.zeros_like(v) for k, v in _expected_state().items()}
    cdcp.load(state, uri, storage_options=options)
    return state


def _assert_saved(uri: str, options: dict) -> None:
    got, want = _loaded(uri, options), _expected_state()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("how,rc", [("manager-end", 0), ("manager-sysexit", 0),
                                    ("manager-raise", 1)])
def test_manager_async_save_is_committed_when_the_script_ends_without_close(s3, how, rc):
    options = _options(s3)
    code, err = _run(how, s3.root, options)
    assert code == rc, err
    assert "checkpoint LOST" not in err, err
    _assert_saved(s3.uri("step-7", "model"), options)
    assert open_checkpoint(s3.uri("step-7"), options).step == 7


def test_unawaited_dcp_async_save_is_committed_at_exit(s3):
    options = _options(s3)
    code, err = _run("dcp-future", s3.uri("dcp"), options)
    assert code == 0, err
    _assert_saved(s3.uri("dcp"), options)


def test_a_save_that_fails_after_the_script_ended_is_an_error_and_the_exit_status(s3):
    options = _options(s3)
    # The target is taken: the background save fails with a conflict nobody awaits.
    cdcp.save({"x": torch.ones(3)}, s3.uri("dcp"), storage_options=options)
    code, err = _run("dcp-future", s3.uri("dcp"), options)
    assert code == EXIT_CONFLICT, err
    assert "checkpoint LOST" in err and s3.uri("dcp") in err and "NOT committed" in err, err


def test_a_failure_the_program_saw_is_not_reported_again_at_exit(s3):
    options = _options(s3)
    cdcp.save({"x": torch.ones(3)}, s3.uri("dcp"), storage_options=options)
    code, err = _run("dcp-seen", s3.uri("dcp"), options)
    assert code == 0, err
    assert "checkpoint LOST" not in err, err


def test_a_save_still_running_at_the_exit_deadline_is_reported(s3, s3_server):
    with FaultProxy(s3_server.endpoint, hold="step-7/cloudckpt-manifest.json") as proxy:
        options = _options(s3, proxy.endpoint)
        start = time.monotonic()
        code, err = _run("manager-end", s3.root, options, CLOUDCKPT_EXIT_TIMEOUT="1")
        took = time.monotonic() - start
        proxy.release.set()
    assert code == EXIT_INCOMPLETE, err
    assert "still running after 1 s; NOT committed" in err and s3.uri("step-7") in err, err
    assert took < 60, took  # bounded by the timeout, not by the held request


def test_sigterm_lets_a_running_save_commit_then_ends_the_process_by_sigterm(s3, s3_server):
    with FaultProxy(s3_server.endpoint, hold="step-7/cloudckpt-manifest.json") as proxy:
        options = _options(s3, proxy.endpoint)
        proc = _start("manager-sleep", s3.root, options)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saving"
        assert proxy.held.wait(60)  # the save is under way, stalled at its manifest
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None, "SIGTERM ended the process before its save finished"
        proxy.release.set()
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, err
    assert "SIGTERM received" in err, err
    _assert_saved(s3.uri("step-7", "model"), _options(s3))


def test_an_unawaited_save_through_the_pinned_pool_is_committed_at_exit(s3):
    options = _options(s3)
    code, err = _run("dcp-future", s3.uri("dcp"), options, THROUGH_POOL="1")
    assert code == 0, err
    _assert_saved(s3.uri("dcp"), options)
