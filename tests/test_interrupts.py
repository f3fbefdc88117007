"""Ctrl-C during a sync save is a KeyboardInterrupt, promptly, after the save's
cleanup: never a StorageError, never swallowed, and nothing is committed. Real
child processes save to moto over HTTP (through a proxy that slows each request,
so the save is still uploading when the signal comes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cloudckpt_testkit import FaultPlan, FaultProxy
from helpers import finish

from cloudckpt import list_checkpoints, open_store

HERE = Path(__file__).parent
CHILD = str(HERE / "sigint_child.py")
# Seconds from the signal to the interrupted save's last line: a bound that catches a
# cleanup stuck on retries or waits, generous enough for a busy machine; not a measure
# of speed (that the save stopped at all is its "interrupted" line).
PROMPT = 20.0


def _start(how: str, uri: str, options: dict, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, CHILD, how, uri], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "CKPT_OPTIONS": json.dumps(options),
                        "PYTHONPATH": str(HERE.parent), **env})


@pytest.fixture
def slow(s3, s3_server):
    """Options reaching moto through a proxy adding 50 ms to every request."""
    with FaultProxy(s3_server.endpoint, FaultPlan(latency_s=0.05)) as proxy:
        options = {**json.loads(s3.options_json()), "endpoint_url": proxy.endpoint}
        yield proxy, options


def _interrupt(proc: subprocess.Popen, when: threading.Event | float) -> tuple[str, float]:
    """SIGINT ``proc`` once ``when`` is set (or after that many seconds past "ready");
    return its last line and the seconds from the signal to that line."""
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    if isinstance(when, threading.Event):
        assert when.wait(60), "the save never reached the point to interrupt"
    else:
        time.sleep(when)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    line = proc.stdout.readline().strip()
    took = time.monotonic() - sent
    finish(proc, what=f"the interrupted save (its last line {line!r})")
    return line, took


def _nothing_committed(s3) -> bool:
    return list_checkpoints(s3.root, s3.options) == [] and not any(
        o.key.endswith("cloudckpt-manifest.json")
        for o in open_store(s3.root, s3.options).list(internal=True))


@pytest.mark.parametrize("how", ["dcp", "manager"])
def test_ctrl_c_mid_upload_is_a_prompt_keyboard_interrupt(s3, slow, how):
    proxy, options = slow
    uploading = threading.Event()
    proxy.on_request = lambda method, target: (
        uploading.set() if method in ("PUT", "POST") and ".distcp" in target else None)
    proc = _start(how, s3.uri("ckpt"), options)
    line, took = _interrupt(proc, uploading)
    assert line.startswith("interrupted"), line
    assert took < PROMPT, f"KeyboardInterrupt came {took:.1f} s after the signal"
    assert proc.returncode == 0
    assert _nothing_committed(s3)


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1])
def test_ctrl_c_in_the_first_moments_of_a_save_is_never_swallowed(s3, s3_server, delay):
    # The manifest's requests are held (then dropped): however late a busy machine
    # delivers the signal, the save cannot have committed before it (on a server that
    # keeps connections alive a slowed save can end within a late signal's delay).
    with FaultProxy(s3_server.endpoint, FaultPlan(latency_s=0.05),
                    hold="cloudckpt-manifest.json", hold_action="drop") as proxy:
        options = {**json.loads(s3.options_json()), "endpoint_url": proxy.endpoint}
        proc = _start("manager", s3.uri("ckpt"), options)
        line, took = _interrupt(proc, delay)
    assert line.startswith("interrupted"), line
    assert took < PROMPT, took
    assert _nothing_committed(s3)


@pytest.mark.parametrize("how", ["dcp", "manager", "writer"])
def test_a_ctrl_c_python_swallowed_still_stops_the_save(s3, how):
    """Python drops a KeyboardInterrupt raised in a finalizer or in a Cython module's
    first import (numpy.random's, in the RNG capture, did so in CI): the save must
    raise it at its commit, not commit."""
    proc = _start(how, s3.uri("ckpt"), json.loads(s3.options_json()), SWALLOW="1")
    out, err = finish(proc, what="the save that swallowed a Ctrl-C")
    assert "Exception ignored" in err and "KeyboardInterrupt" in err, err  # it was dropped
    assert out.splitlines()[-1].startswith("interrupted"), out + err
    assert _nothing_committed(s3)


def test_an_uncaught_ctrl_c_ends_the_process_as_sigint(s3, slow):
    _, options = slow
    proc = _start("dcp", s3.uri("ckpt"), options, CATCH="0")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc, what="the save with its Ctrl-C uncaught")
    assert proc.returncode == -signal.SIGINT, err
    assert "KeyboardInterrupt" in err and "StorageError" not in err, err
    assert "saved" not in out


def test_ctrl_c_while_copying_through_the_pinned_pool_is_a_prompt_keyboard_interrupt(
        s3, slow, tmp_path):
    _, options = slow
    marker = tmp_path / "copying"
    copying = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if marker.exists():
            copying.set()

    threading.Thread(target=watch, daemon=True).start()
    proc = _start("dcp", s3.uri("ckpt"), options, THROUGH_POOL="1", COPY_MARKER=str(marker))
    line, took = _interrupt(proc, copying)
    assert line.startswith("interrupted"), line
    assert took < PROMPT, f"KeyboardInterrupt came {took:.1f} s after the signal"
    assert proc.returncode == 0
    assert _nothing_committed(s3)
