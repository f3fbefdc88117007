"""One normalisation of URIs for writes, listings and deletes: ``~`` and relative
``file://`` paths mean what they mean to fsspec, and a ``//`` inside a URI names the
same keys as ``/`` (moto over HTTP for the bucket cases)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cloudckpt import (
    CheckpointManager,
    CheckpointWriter,
    ManagerOptions,
    StepInfo,
    latest_checkpoint,
    list_checkpoints,
    open_store,
)
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.errors import ConfigError


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """A home directory and a working directory, apart."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    return tmp_path


def _save(root: str, **options) -> None:
    mgr = CheckpointManager(root, ManagerOptions(), storage_options=options)
    mgr.save(StepInfo(), {"w": torch.ones(3)}, force=True)
    mgr.close()


@pytest.mark.parametrize("root", ["~/runs/x", "file://~/runs/x"])
def test_tilde_is_the_home_directory(elsewhere, root):
    _save(root, fsync=False)
    assert (elsewhere / "home" / "runs" / "x" / "step-0" / "cloudckpt-manifest.json").is_file()
    assert not (elsewhere / "cwd" / "~").exists()
    assert open_store(root).uri == str(elsewhere / "home" / "runs" / "x")


@pytest.mark.parametrize("root", ["rel/run", "file://rel/run", "./rel/run"])
def test_relative_paths_are_relative_to_the_working_directory(elsewhere, root):
    _save(root, fsync=False)
    assert (elsewhere / "cwd" / "rel" / "run" / "step-0" / "cloudckpt-manifest.json").is_file()
    assert [c.name for c in list_checkpoints("rel/run")] == ["step-0"]


def test_a_double_slash_in_a_uri_names_the_same_keys(s3):
    root = s3.root + "/"  # a root written with a trailing slash, then joined with "/"
    with CheckpointWriter(root + "/step-1", step=1, storage_options=s3.options) as w:
        w.put("a.bin", b"x" * 100)
    with CheckpointWriter(s3.root + "//nested//step-2", step=2, storage_options=s3.options) as w:
        w.put("b.bin", b"y" * 100)
    # Listings, latest and deletes all see what the writes made.
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == ["step-1"]
    assert latest_checkpoint(root, s3.options).uri == s3.uri("step-1")
    assert latest_checkpoint(s3.uri("nested"), s3.options).step == 2
    store = open_store(s3.root, s3.options)
    with pytest.raises(ConfigError, match="empty"):  # keys are checked, not rewritten
        store.child("nested//step-2")
    keys = {o.key for o in store.list(internal=True)}
    assert keys == {"step-1/a.bin", "step-1/cloudckpt-manifest.json",
                    "nested/step-2/b.bin", "nested/step-2/cloudckpt-manifest.json"}
    delete_checkpoint(s3.root + "//step-1", s3.options)
    assert list_checkpoints(s3.root, s3.options) == []
