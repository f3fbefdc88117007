"""A part of a save that never committed is no checkpoint of its own.

A training checkpoint's DCP part (``step-1/model/``) commits its own manifest before
the root manifest commits the whole. A copy cut short by Ctrl-C (``cloudckpt cp`` as
a real child process, SIGINTed while one object is held in flight by a proxy in front
of moto) leaves that part committed below an uncommitted top: ``latest``, ``ls``,
``latest_checkpoint`` and every open or restore must pass it over, saying why.
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
import torch
from cloudckpt_testkit import FaultProxy

import cloudckpt.dcp as cdcp
from cloudckpt import (
    CheckpointManager,
    StepInfo,
    latest_checkpoint,
    list_checkpoints,
    open_checkpoint,
    open_store,
)
from cloudckpt.cli import main
from cloudckpt.errors import IncompleteCheckpointError
from cloudckpt.names import CLAIM_NAME, MANIFEST_NAME
from cloudckpt.training import multipart

#: The object of the source a copy is held on: not in the model part.
HELD = "state/shared.bin"


def _training_checkpoint(root: str, options: dict) -> None:
    mgr = CheckpointManager(root, storage_options=options)
    mgr.save(StepInfo(global_step=1), {"w": torch.arange(64, dtype=torch.float32)}, force=True)
    mgr.close()


def _wait_for(condition, what: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


@pytest.fixture
def torn_copy(s3, s3_server, tmp_path) -> Path:
    """``cloudckpt cp`` of a committed training checkpoint from moto to local disk,
    interrupted with SIGINT while its shared state is held in flight: the destination
    holds the committed model part and the copy's claim, no root manifest."""
    _training_checkpoint(s3.uri("run"), s3.options)
    dst = tmp_path / "dst" / "step-1"
    with FaultProxy(s3_server.endpoint, hold=HELD) as proxy:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cloudckpt", "-o", f"endpoint_url={proxy.endpoint}",
             "-o", f"key={s3.options['key']}", "-o", f"secret={s3.options['secret']}",
             "cp", s3.uri("run", "step-1"), str(dst), "--dst-option", "fsync=false"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            # Ctrl-C as at a terminal, even where this test runs with SIGINT ignored (a
            # background job of a non-interactive shell), which the child would inherit.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            assert proxy.held.wait(120), "the copy never asked for the held object"
            _wait_for(lambda: (dst / "model" / MANIFEST_NAME).is_file(),
                      "the model part's manifest was copied")
            proc.send_signal(signal.SIGINT)
            # Released only once the signal is sent: the commit, after the last object,
            # can no longer run (the child's main thread raises KeyboardInterrupt first).
            proxy.release.set()
            out, err = proc.communicate(timeout=120)
        finally:
            proxy.release.set()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130 and "interrupted" in err, (out, err)
    assert (dst / CLAIM_NAME).is_file() and not (dst / MANIFEST_NAME).exists()
    return dst


def test_a_torn_copy_s_model_part_resolves_nowhere(torn_copy, s3, caplog, capsys):
    dst, part = str(torn_copy), str(torn_copy / "model")
    why = f"part of the save at {dst}, which never committed"

    # latest_checkpoint and list_checkpoints: passed over with a WARNING saying why.
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert latest_checkpoint(dst) is None
        assert list_checkpoints(dst) == []
    assert why in caplog.text
    listed = {i.name: i for i in list_checkpoints(dst, include_uncommitted=True)}
    assert (listed["model"].committed, listed["model"].status) == (False, "part")
    assert not any(i.committed for i in listed.values())

    # cloudckpt latest: the root is a save that never committed, its part passed over.
    capsys.readouterr()
    caplog.clear()
    assert main(["latest", dst]) == 4
    out, err = capsys.readouterr()
    assert out == "" and f"{dst} holds a save that never committed" in err
    assert why in caplog.text

    # cloudckpt ls: the part is shown as what it is.
    assert main(["ls", dst]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("model"))
    assert "part of an uncommitted save (not a checkpoint)" in line

    # Opening or restoring the part itself: refused, saying why and what to do.
    with pytest.raises(IncompleteCheckpointError, match=why) as refused:
        open_checkpoint(part)
    assert f"cloudckpt rm --force {dst}" in str(refused.value)
    assert main(["info", part]) == 4 and why in capsys.readouterr().err
    with pytest.raises(IncompleteCheckpointError, match=why):
        cdcp.load({"w": torch.zeros(64)}, part)
    state = {"w": torch.zeros(64)}
    assert CheckpointManager(dst).restore(state) is None
    assert torch.equal(state["w"], torch.zeros(64))

    # The copy run again completes it: then its part opens, as a part of a committed whole.
    assert main(["-o", f"endpoint_url={s3.options['endpoint_url']}",
                 "-o", f"key={s3.options['key']}", "-o", f"secret={s3.options['secret']}",
                 "cp", s3.uri("run", "step-1"), dst, "--dst-option", "fsync=false"]) == 0
    assert latest_checkpoint(str(torn_copy.parent)).uri == dst
    assert open_checkpoint(part).manifest.kind == "dcp"


class _Fails:
    """A part that fails once the model part has committed: a save cut short."""

    def write(self, store, group):
        raise RuntimeError("the save failed after its model part")

    def commit(self, writer, written):  # pragma: no cover - never reached
        raise AssertionError


def test_a_failed_save_s_model_part_is_no_checkpoint(local, memory):
    for backend in (local, memory):
        run = open_store(backend.uri("run"), backend.options)
        with pytest.raises(RuntimeError, match="after its model part"):
            multipart.save(run.child("step-3"), [
                multipart.DcpPart("model", {"w": torch.ones(4)}, step=3), _Fails()])
        assert run.child("step-3/model").exists(MANIFEST_NAME)
        assert list_checkpoints(run.child("step-3")) == []
        assert latest_checkpoint(run.child("step-3")) is None
        with pytest.raises(IncompleteCheckpointError, match="never committed"):
            open_checkpoint(run.child("step-3/model"))
        # A DCP checkpoint a user named "model" in a plain directory is one of its own.
        cdcp.save({"w": torch.ones(4)}, run.child("mine/model"))
        assert [c.name for c in list_checkpoints(run.child("mine"))] == ["model"]
        assert open_checkpoint(run.child("mine/model")).manifest.kind == "dcp"


def test_parts_of_a_committed_checkpoint_still_open(s3):
    _training_checkpoint(s3.uri("run"), s3.options)
    part = open_checkpoint(s3.uri("run", "step-1", "model"), s3.options)
    assert part.manifest.kind == "dcp"
    assert json.loads(open_checkpoint(s3.uri("run", "step-1"), s3.options)
                      .read("model/" + MANIFEST_NAME))["commit_id"] == part.manifest.commit_id
