"""One normalisation of URIs for writes, listings and deletes: ``~`` and relative
``file://`` paths mean what they mean to fsspec, a ``//`` inside a URI names the
same keys as ``/``, and a ``.`` or ``..`` segment is refused alike on every backend
(moto, fake-gcs-server and Azurite over HTTP for the bucket cases)."""

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
from cloudckpt.cli import main
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.errors import ConfigError
from cloudckpt.storage.backends.fsspec_generic import FsspecGenericBackend


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
                    "nested/step-2/b.bin", "nested/step-2/cloudckpt-manifest.json",
                    "cloudckpt-index.json", "nested/cloudckpt-index.json"}  # listed: indexed
    delete_checkpoint(s3.root + "//step-1", s3.options)
    assert list_checkpoints(s3.root, s3.options) == []


#: Dot segments after a root: the segment, and what the refusal says to write instead
#: (below the root).
DOTTED = {"uni/../escape/step-1": ("..", "/escape/step-1"), "uni/./step-1": (".", "/uni/step-1"),
          "step-1/..": ("..", ""), "./step-1": (".", "/step-1")}


@pytest.mark.parametrize("tail", sorted(DOTTED))
def test_dot_segments_are_refused_alike_on_every_backend(backend, tail):
    uri = f"{backend.root}/{tail}"
    segment, below = DOTTED[tail]
    said, normal = f"{segment!r} segment", backend.root + below
    opts = backend.options
    refusals = [lambda: open_store(uri, opts),
                lambda: CheckpointWriter(uri, step=1, storage_options=opts).put("a.bin", b"x"),
                lambda: _save(uri, **opts),
                lambda: list_checkpoints(uri, opts),
                lambda: latest_checkpoint(uri, opts),
                lambda: delete_checkpoint(uri, opts)]
    for refused in refusals:
        with pytest.raises(ConfigError) as info:
            refused()
        assert said in str(info.value) and str(info.value).endswith(f": {normal}")
    # Nothing was written anywhere: the refusal comes before the first request.
    assert open_store(backend.root, opts).list(internal=True) == []
    if backend.name == "file":
        assert not Path(backend.root).exists()


def test_the_command_refuses_dot_segments_saying_what_to_write(local, capsys):
    assert main(["ls", f"{local.root}/runs/../escape"]) == 2
    err = capsys.readouterr().err
    assert "'..' segment" in err and err.rstrip().endswith(f"{local.root}/escape")


def test_a_generic_fsspec_uri_refuses_dot_segments_too():
    options = {"target_protocol": "memory"}  # simplecache over memory: no server needed
    assert isinstance(open_store("simplecache://bkt/run", options).backend,
                      FsspecGenericBackend)
    with pytest.raises(ConfigError, match="'..' segment.*simplecache://bkt/escape$"):
        open_store("simplecache://bkt/run/../escape", options)


def test_leading_dot_segments_of_a_relative_local_path_stay_relative(elsewhere):
    (elsewhere / "runs").mkdir()
    _save("../runs/x", fsync=False)
    assert (elsewhere / "runs" / "x" / "step-0" / "cloudckpt-manifest.json").is_file()
    assert open_store("./../runs/x").uri == str(elsewhere / "runs" / "x")
    with pytest.raises(ConfigError, match="'..' segment"):
        open_store("../runs/x/../y")
