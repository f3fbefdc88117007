"""One hand-edited manifest with a field out of range (``created: 1e308``, a negative
time, a string, a huge integer) is a corrupt checkpoint, never a crash: ``ls`` shows
it unreadable among the others, ``info`` exits 1 saying why, ``latest``, ``gc`` and
retention skip it with a WARNING and never delete it."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import torn_save
from test_cli import make, run_cli, s3_args
from test_manager import run

from cloudckpt import (
    MANIFEST_NAME,
    CheckpointManager,
    ManagerOptions,
    ManifestError,
    StepInfo,
    list_checkpoints,
    open_store,
)
from cloudckpt.cli import main
from cloudckpt.core.manifest import MAX_CREATED, Manifest
from cloudckpt.errors import EXIT_CORRUPT, EXIT_OK
from cloudckpt.names import BLOB_AREA

#: (field, value as JSON text): each makes a manifest malformed.
BAD = [
    ("created", "1e308"), ("created", "-1.0"), ("created", '"NaN"'), ("created", "NaN"),
    ("created", "Infinity"), ("created", str(10**30)), ("created", str(int(MAX_CREATED) + 1)),
    ("created", '"yesterday"'), ("created", "[1]"), ("created", "true"),
    ("step", str(2**63)), ("step", '"7"'), ("step", "1.5"),
    ("size", "-1"), ("size", str(2**64)), ("size", '"3000"'),
    ("kind", json.dumps("k" * 1000)), ("commit_id", "{}"),
]
IDS = [f"{field}={text[:12]}" for field, text in BAD]


def rewrite(backend, name: str, field: str, text: str) -> None:
    """Replace ``field`` of checkpoint ``name``'s manifest (a file's size, for
    ``size``) with the JSON ``text``, as a hand edit would."""
    store = open_store(backend.uri(name), backend.options)
    doc = json.loads(store.get(MANIFEST_NAME))
    target = next(iter(doc["files"].values())) if field == "size" else doc
    target["size" if field == "size" else field] = "@BAD@"
    store.delete([MANIFEST_NAME])
    store.put(MANIFEST_NAME, json.dumps(doc).replace('"@BAD@"', text).encode())


def three_steps(backend, bad: int, field: str, text: str) -> None:
    for step in (1, 2, 3):
        make(backend, f"step-{step}", step, n=2)
    rewrite(backend, f"step-{bad}", field, text)


@pytest.mark.parametrize("field, text", BAD, ids=IDS)
def test_a_bad_field_is_a_ManifestError_naming_it(field, text):
    good = json.loads(Manifest(files={}, step=1).to_json())
    good["files"] = {"a.bin": {"size": 4, "crc32c": "00000000"}}
    target = good["files"]["a.bin"] if field == "size" else good
    target[field] = "@BAD@"
    data = json.dumps(good).replace('"@BAD@"', text).encode()
    with pytest.raises(ManifestError, match=rf"bad '?{field}'?.*fall back"):
        Manifest.from_json(data, source="m.json")


@pytest.mark.parametrize("field, text", BAD, ids=IDS)
def test_ls_info_latest_and_gc_show_the_rest_of_the_run(local, field, text, capsys, caplog):
    three_steps(local, 3, field, text)
    torn_save(local.uri("step-4"), local.options, {"x": b"x"})
    assert main(["ls", local.root]) == EXIT_OK
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["step-3"].endswith("UNREADABLE")
    assert rows["step-1"].endswith("committed") and rows["step-2"].split()[1] == "2"
    assert main(["ls", "--json", local.root]) == EXIT_OK
    listed = {d["name"]: d for d in json.loads(capsys.readouterr().out)}
    assert listed["step-3"]["status"] == "unreadable" and field in listed["step-3"]["error"]

    assert main(["info", local.uri("step-3")]) == EXIT_CORRUPT
    err = capsys.readouterr().err
    assert f"{field}" in err and "malformed" in err and "internal error" not in err
    assert main(["info", local.uri("step-2")]) == EXIT_OK
    assert "step:      2" in capsys.readouterr().out

    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert main(["latest", local.root]) == EXIT_OK
    assert capsys.readouterr().out.strip() == local.uri("step-2")
    assert "skipping" in caplog.text and "step-3" in caplog.text and field in caplog.text

    assert main(["gc", "--grace", "0", "--yes", local.root]) == EXIT_OK
    capsys.readouterr()
    left = {o.key.split("/")[0] for o in open_store(local.root, local.options).list()}
    # the torn save went, the bad one stays (and the root index the listings wrote)
    assert left == {"step-1", "step-2", "step-3", "cloudckpt-index.json"}


def test_the_command_exits_1_for_created_1e308_on_s3(s3):
    three_steps(s3, 2, "created", "1e308")
    info = run_cli(s3, *s3_args(s3), "info", s3.uri("step-2"))
    assert info.returncode == EXIT_CORRUPT and "'created'" in info.stderr, info.stderr
    for command in ("ls", "latest", "gc"):
        done = run_cli(s3, *s3_args(s3), command, s3.root)
        assert done.returncode == EXIT_OK, (command, done.stderr)
    assert run_cli(s3, *s3_args(s3), "latest", s3.root).stdout.strip() == s3.uri("step-3")


def test_retention_and_resume_skip_a_bad_manifest_and_never_delete_it(local, caplog):
    opts = ManagerOptions(every_steps=1, keep_last=2)
    run(CheckpointManager(local.root, opts, storage_options=local.options), range(0, 3))
    rewrite(local, "step-2", "created", "1e308")
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        run(CheckpointManager(local.root, opts, storage_options=local.options), range(3, 6))
    assert "skipping" in caplog.text and "step-2" in caplog.text
    listed = list_checkpoints(local.root, local.options, include_uncommitted=True)
    assert [(c.name, c.status) for c in listed] == [
        ("step-2", "unreadable"), ("step-4", "committed"), ("step-5", "committed")]
    rewrite(local, "step-5", "created", "-1")
    state = {"w": torch.zeros(8)}
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        info = CheckpointManager(local.root, opts, storage_options=local.options).restore(state)
    assert info == StepInfo(epoch=1, epoch_step=0, global_step=4, steps_per_epoch=4)
    assert torch.equal(state["w"], torch.full((8,), 4.0))
    assert "step-5" in caplog.text and "bad 'created'" in caplog.text


def test_gc_leaves_the_blob_area_while_a_manifest_is_unreadable(local, caplog, capsys):
    opts = ManagerOptions(every_steps=1, incremental=True)
    run(CheckpointManager(local.root, opts, storage_options=local.options), range(0, 2),
        value_of=lambda g: float(g % 2))
    area = open_store(local.uri(BLOB_AREA), local.options)
    blobs = sorted(o.key for o in area.list())
    area.put("0" * 64, b"a blob no checkpoint references")
    rewrite(local, "step-1", "created", "1e308")
    torn_save(local.uri("step-7"), local.options, {"x": b"x"})
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert main(["gc", "--grace", "0", "--yes", local.root]) == EXIT_OK
    capsys.readouterr()
    assert "leaving the blobs" in caplog.text and "step-1" in caplog.text
    assert sorted(o.key for o in area.list()) == sorted([*blobs, "0" * 64])
    assert not open_store(local.uri("step-7"), local.options).list()


@pytest.mark.parametrize("world", ['"eight"', "0", "null", str(2**40)])
def test_a_bad_world_size_is_a_corrupt_checkpoint_resume_falls_back_from(local, world,
                                                                          caplog):
    """What a training checkpoint's metadata says cloudckpt reads (``world_size``) is
    range-checked like the manifest's own fields: a bad one is corruption, not a
    crash of the resume."""
    opts = ManagerOptions(every_steps=1)
    run(CheckpointManager(local.root, opts, storage_options=local.options), range(0, 3))
    store = open_store(local.uri("step-2"), local.options)
    doc = json.loads(store.get(MANIFEST_NAME))
    doc["metadata"]["world_size"] = "@BAD@"
    store.delete([MANIFEST_NAME])
    store.put(MANIFEST_NAME, json.dumps(doc).replace('"@BAD@"', world).encode())
    state = {"w": torch.zeros(8)}
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        info = CheckpointManager(local.root, opts, storage_options=local.options).restore(state)
    assert info.global_step == 1 and torch.equal(state["w"], torch.full((8,), 1.0))
    assert "step-2 is corrupt" in caplog.text and "world_size" in caplog.text
