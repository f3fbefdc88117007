"""Staging directories left by a process killed mid-save are removed on relaunch, and
nothing else ever is: a live owner's, another host's, a directory without cloudckpt's
marker, a marker cloudckpt did not write, a symbolic link."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from cloudckpt import open_checkpoint
from cloudckpt.core.liveness import this_process
from cloudckpt.training.staging import MARKER_FORMAT, remove_leftovers, staging_dir

CHILD = Path(__file__).parent / "staging_child.py"


def _child(mode: str, s3, staging: Path) -> subprocess.Popen:
    env = {**os.environ, "CLOUDCKPT_STAGING": str(staging), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(CHILD), mode, s3.uri("experiments"),
                             s3.options_json()], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _mark(root: Path, name: str, owner: dict, **doc) -> Path:
    """A directory with a file in it, and a marker naming ``owner`` beside it."""
    (root / name).mkdir(parents=True)
    (root / name / "model.safetensors").write_bytes(b"x" * 100)
    marker = root / f"{name}.owner-0.json"
    marker.write_text(json.dumps({"format": MARKER_FORMAT, "version": 1, "directory": name,
                                  "owners": [owner], **doc}))
    return marker


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _staged(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


def test_sigkilled_staged_save_is_removed_on_relaunch(s3, tmp_path):
    root = tmp_path / "staging"
    root.mkdir()
    (root / "cloudckpt-staging-0123456789ab").mkdir()  # no marker: not provably ours
    (root / "cloudckpt-staging-0123456789ab" / "data").write_text("keep")
    (root / "users-own").mkdir()
    before = _staged(root)

    held = _child("hold", s3, root)
    assert held.stdout is not None
    line = held.stdout.readline()
    assert line.startswith("staged "), line + held.stderr.read()
    staged = Path(line.split(" ", 1)[1].strip())
    assert staged.parent == root and (staged / "model.safetensors").is_file()
    # While its owner runs, another process's staging leaves it alone.
    with staging_dir(root) as mine:
        assert mine != staged and staged.is_dir()
    assert (staged / "model.safetensors").is_file()

    held.send_signal(signal.SIGKILL)
    held.wait(timeout=30)
    held.stdout.close()
    held.stderr.close()
    assert (staged / "config.json").is_file()  # the crash left a full copy behind

    relaunch = _child("finish", s3, root)
    out, err = relaunch.communicate(timeout=120)
    assert relaunch.returncode == 0, err[-3000:]
    assert not staged.exists()
    assert f"removed {staged}" in err  # said, at WARNING
    assert _staged(root) == before  # nothing of anyone else's went
    assert (root / "cloudckpt-staging-0123456789ab" / "data").read_text() == "keep"
    uri = out.split("exported ", 1)[1].strip()
    open_checkpoint(uri, s3.options).verify(deep=True)


def test_only_provably_dead_owners_lose_their_staging(tmp_path, caplog):
    root = tmp_path / "staging"
    root.mkdir()
    me = this_process()
    recycled = _mark(root, "cloudckpt-staging-000000000001",
                     {**me, "started_ticks": "1"})  # this pid, but a process started earlier
    dead = _mark(root, "cloudckpt-staging-000000000002", {**me, "pid": _dead_pid()})
    gone_no_dir = root / "cloudckpt-staging-000000000003.owner-0.json"  # died before mkdir
    gone_no_dir.write_text(json.dumps({"format": MARKER_FORMAT, "directory":
                                       "cloudckpt-staging-000000000003",
                                       "owners": [{**me, "pid": _dead_pid()}]}))
    kept = {
        "live": _mark(root, "cloudckpt-staging-00000000000a", me),
        "other host": _mark(root, "cloudckpt-staging-00000000000b",
                            {**me, "host": "another-node", "pid": _dead_pid()}),
        "other boot": _mark(root, "cloudckpt-staging-00000000000c",
                            {**me, "boot_id": "another-boot", "pid": _dead_pid()}),
        "no pid": _mark(root, "cloudckpt-staging-00000000000d", {**me, "pid": None}),
        "other directory": _mark(root, "cloudckpt-staging-00000000000e",
                                 {**me, "pid": _dead_pid()},
                                 directory="cloudckpt-staging-00000000000f"),
    }
    foreign = _mark(root, "cloudckpt-staging-000000000010", {**me, "pid": _dead_pid()})
    foreign.write_text(json.dumps({"owners": [{**me, "pid": _dead_pid()}]}))  # not ours
    kept["foreign format"] = foreign
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep")
    (root / "cloudckpt-staging-000000000011").symlink_to(elsewhere)
    link_marker = root / "cloudckpt-staging-000000000011.owner-0.json"
    link_marker.write_text(json.dumps({"format": MARKER_FORMAT, "directory":
                                       "cloudckpt-staging-000000000011",
                                       "owners": [{**me, "pid": _dead_pid()}]}))

    caplog.set_level(logging.INFO, logger="cloudckpt")
    removed = remove_leftovers(root)
    assert sorted(p.name for p in removed) == ["cloudckpt-staging-000000000001",
                                               "cloudckpt-staging-000000000002"]
    for marker in (recycled, dead):
        assert not marker.exists() and not (root / marker.name.split(".")[0]).exists()
    assert not gone_no_dir.exists()
    assert "staging left by a save that died" in caplog.text
    for why, marker in kept.items():
        assert marker.exists(), why
        assert (root / marker.name.split(".")[0] / "model.safetensors").is_file(), why
    assert (elsewhere / "precious").read_text() == "keep" and link_marker.exists()

    # A staging of this process's own: its marker is there while it lives, gone after.
    with staging_dir(root) as path:
        markers = list(root.glob(f"{path.name}.owner-*.json"))
        assert path.is_dir() and len(markers) == 1
        assert json.loads(markers[0].read_text())["owners"] == [me]
        assert remove_leftovers(root) == [] and path.is_dir()
    assert not path.exists() and not markers[0].exists()
