"""A user's natural mistakes never lose data, and every error says what is wrong.

Each test reproduces one finding of issue 11 over real endpoints (moto S3,
fake-gcs-server, local disk) and checks what cloudckpt does now.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import subprocess
import sys

import pytest
import torch
from helpers import HUB_TOKEN, torn_save

from cloudckpt import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointManager,
    CheckpointWriter,
    ConfigError,
    CorruptCheckpointError,
    ManagerOptions,
    StateMismatchError,
    StepInfo,
    latest_checkpoint,
    list_checkpoints,
    open_checkpoint,
    open_store,
)
from cloudckpt.cli import build_parser, main
from cloudckpt.core.claim import CLAIM_NAME
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.runtime.state import loads_state


def opts_args(backend) -> list[str]:
    """The backend's storage options as CLI -o flags (retry policies left out)."""
    return [a for k, v in backend.options.items() if k != "retry" for a in ("-o", f"{k}={v}")]


def commit(backend, name: str, step: int, objects: dict[str, bytes] | None = None, *,
           kind: str = "generic") -> dict:
    objects = objects or {f"part-{i}.bin": os.urandom(2000 + i) for i in range(3)}
    with CheckpointWriter(backend.uri(name), step=step, kind=kind,
                          storage_options=backend.options) as w:
        w.put_many(objects)
    return objects


def cli(backend, *args: str, env: dict[str, str] | None = None,
        **kw) -> subprocess.CompletedProcess:
    """``python -m cloudckpt`` in a child process, as a user runs it."""
    full = {**os.environ, **backend.env, **(env or {})}
    return subprocess.run([sys.executable, "-m", "cloudckpt", *args], capture_output=True,
                          text=True, env=full, timeout=120, **kw)


def keys(backend, uri: str) -> list[str]:
    return [o.key for o in open_store(uri, backend.options).list(internal=True)]


# -------------------------------------------------- 1 and 11: nothing deletes a root


def test_a_root_survives_every_destructive_command(s3, tmp_path, capsys):
    one = commit(s3, "step-1", 1)
    two = commit(s3, "step-2", 2)
    root = open_store(s3.root, s3.options)
    root.put("logs/train.log", b"epoch 1 ...")
    root.put("datasets/shard-0.bin", os.urandom(5000))
    torn_save(s3.uri("step-3"), s3.options, {"part-0.bin": b"torn"})  # cloudckpt's own
    o = opts_args(s3)

    assert main([*o, "info", s3.root]) == 2
    err = capsys.readouterr().err
    assert "root holding 2 committed checkpoints" in err and "rm --force" not in err
    assert main([*o, "rm", "--force", s3.root]) == 2
    assert "nothing was deleted" in capsys.readouterr().err
    assert main([*o, "rm", "--recursive", s3.root]) == 2  # no terminal to ask on, no --yes
    assert "--yes" in capsys.readouterr().err
    assert main([*o, "cp", s3.uri("step-1"), s3.root]) == 2
    assert "root holding" in capsys.readouterr().err
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("my own notes")
    assert main([*o, "download", s3.uri("step-1"), str(dest)]) == 2
    assert "did not write" in capsys.readouterr().err
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    assert (dest / "notes.txt").read_text() == "my own notes"
    assert main([*o, "gc", "--yes", "--grace", "0", s3.root]) == 0
    out = capsys.readouterr().out
    assert "step-3" in out and "logs" not in out and "datasets" not in out

    assert keys(s3, s3.uri("step-3")) == []
    assert root.get("logs/train.log") == b"epoch 1 ..." and root.exists("datasets/shard-0.bin")
    for name, objs in (("step-1", one), ("step-2", two)):
        ckpt = open_checkpoint(s3.uri(name), s3.options)
        ckpt.verify(deep=True)
        assert ckpt.read_many(sorted(objs)) == objs

    # Asked and confirmed: the checkpoints go, the user's objects stay.
    assert main([*o, "rm", "--recursive", "--yes", s3.root]) == 0
    assert "left 2 objects cloudckpt did not write" in capsys.readouterr().out
    assert [k for k in keys(s3, s3.root)] == ["datasets/shard-0.bin", "logs/train.log"]


def test_gc_counts_only_what_cloudckpt_wrote(local, capsys):
    commit(local, "step-1", 1)
    torn_save(local.uri("step-2"), local.options, {"a.bin": b"a" * 100})
    store = open_store(local.root, local.options)
    store.put("logs/run.log", b"log")
    store.put("datasets/x.bin", b"data")
    old = os.path.getmtime(local.root) - 7200
    for d, _, files in os.walk(local.root):
        for f in files:
            os.utime(os.path.join(d, f), (old, old))
    assert main(["gc", "--grace", "3600", local.root]) == 0
    dry = capsys.readouterr().out
    assert dry.count("would remove") == 1 and "step-2" in dry
    assert "--yes deletes 1 prefix (2 objects)" in dry
    assert main(["gc", "--grace", "3600", "--yes", local.root]) == 0
    assert "removed 1 prefix (2 objects)" in capsys.readouterr().out
    assert sorted(o.key for o in store.list(internal=True)) == [
        "datasets/x.bin", "logs/run.log", "step-1/cloudckpt-manifest.json",
        "step-1/part-0.bin", "step-1/part-1.bin", "step-1/part-2.bin"]


# ------------------------------------------------------- 2: keys are taken literally


@pytest.fixture(params=["s3", "gcs", "file"])
def literal_backend(request):
    return request.getfixturevalue({"file": "local"}.get(request.param, request.param))


def test_glob_characters_in_names_are_literal(literal_backend, caplog):
    b = literal_backend
    commit(b, "g[ab]/step-1", 1)
    sibling = commit(b, "ga/step-1", 1)  # the pattern g[ab] would match "ga"
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert delete_checkpoint(b.uri("g[ab]/step-1"), b.options) == 4
        mgr = CheckpointManager(b.uri("exp2[a]"), ManagerOptions(every_steps=1, keep_last=2),
                                storage_options=b.options)
        for step in range(4):
            mgr.save(StepInfo(global_step=step), {"w": torch.full((4,), float(step))}, rng=False)
        mgr.close()
    assert "could not remove" not in caplog.text
    assert keys(b, b.uri("g[ab]")) == []
    assert open_checkpoint(b.uri("ga/step-1"), b.options).read_many(sorted(sibling)) == sibling
    assert [c.name for c in list_checkpoints(b.uri("exp2[a]"), b.options)] == ["step-2", "step-3"]
    assert not [k for k in keys(b, b.uri("exp2[a]")) if k.endswith(CLAIM_NAME)]


def test_rm_with_a_pattern_is_not_found_not_a_traceback(s3):
    commit(s3, "glob[1]/step-11", 11)
    done = cli(s3, *opts_args(s3), "rm", s3.uri("glob[1]/step-*1"))
    assert done.returncode == 3, done.stderr
    assert "no checkpoint at" in done.stderr and "Traceback" not in done.stderr
    open_checkpoint(s3.uri("glob[1]/step-11"), s3.options).verify()


# ------------------------------------------- 3: what cannot be restored is not saved


class _Cursor:
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class _LeakyState(_Cursor):
    def state_dict(self):
        return {"pos": self.pos, "gen": (i for i in range(3))}


def test_state_that_cannot_be_restored_is_refused_before_anything_is_written(s3):
    mgr = CheckpointManager(s3.root, ManagerOptions(every_steps=1), storage_options=s3.options)
    state = {"w": torch.ones(4)}
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    with pytest.raises(ConfigError, match=r"per_rank\['data'\] is a DataLoader.*state_dict"):
        mgr.save(StepInfo(), state, per_rank={"data": loader})
    with pytest.raises(ConfigError, match=r"extra\['fn'\] is a function"):
        mgr.save(StepInfo(), state, extra={"fn": lambda x: x})
    with pytest.raises(ConfigError, match=r"per_rank\['c'\]: the state_dict\(\) of a _LeakyState"):
        mgr.save(StepInfo(), state, per_rank={"c": _LeakyState()})
    assert keys(s3, s3.root) == []  # nothing was written
    cursor = _Cursor()
    cursor.pos = 5
    mgr.save(StepInfo(), state, per_rank={"c": cursor}, extra={"lr": [0.1, 0.01]})
    mgr.close()
    back = _Cursor()
    info = CheckpointManager(s3.root, storage_options=s3.options).restore(
        {"w": torch.zeros(4)}, per_rank={"c": back})
    assert info is not None and back.pos == 5


def test_a_refused_pickle_is_explained_in_one_clean_line():
    import io

    buf = io.BytesIO()
    torch.save(torch.utils.data.DataLoader([1, 2]), buf)
    with pytest.raises(CorruptCheckpointError) as exc:
        loads_state(b"T" + buf.getvalue(), source="state/rank-00000.bin")
    text = str(exc.value)
    assert "\x1b" not in text and "\n" not in text
    assert "DataLoader was not an allowed global" in text
    assert "weights_only` set to `False`" not in text  # no advice to load unsafely


# ------------------------------------------------- 4 and 6: full disk, resumed transfers


def _limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_download_onto_a_full_disk_says_so_and_resumes(s3, tmp_path):
    objects = {"a.bin": os.urandom(10_000), "b.bin": os.urandom(200_000),
               "c.bin": os.urandom(10_000)}
    commit(s3, "step-1", 1, objects)
    dest = tmp_path / "dl"
    full = cli(s3, *opts_args(s3), "download", s3.uri("step-1"), str(dest),
               preexec_fn=_limit_file_size(100_000))
    assert full.returncode == 8, full.stderr
    assert "file size limit" in full.stderr and "Traceback" not in full.stderr
    leftovers = [p.name for p in dest.rglob("*") if p.is_file()]
    assert not [n for n in leftovers if ".cloudckpt-tmp-" in n]  # no partial files
    again = cli(s3, *opts_args(s3), "download", s3.uri("step-1"), str(dest))
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_bytes() for p in dest.iterdir() if p.name in objects} == objects
    open_checkpoint(str(dest)).verify(deep=True)
    assert not (dest / CLAIM_NAME).exists()


@pytest.fixture(params=["s3", "gcs", "file"])
def copy_dest(request):
    return request.getfixturevalue({"file": "local"}.get(request.param, request.param))


def test_an_interrupted_copy_resumes_and_leaves_no_parts(s3, copy_dest, monkeypatch):
    from cloudckpt.movement import checkpoint_copy

    objects = {f"obj-{i}.bin": os.urandom(3000 + i) for i in range(6)}
    objects["big.bin"] = os.urandom(3 * 1024 * 1024)  # streamed in parts
    commit(s3, "step-1", 1, objects)
    src = open_checkpoint(s3.uri("step-1"), s3.options)
    dst = copy_dest.uri("copy")
    opts = {**copy_dest.options, "part_size": 256 * 1024}
    real = checkpoint_copy._copy_objects
    copied: list[str] = []

    def interrupted(ckpt, writer, paths, progress):
        real(ckpt, writer, paths[:3], progress)
        copied.extend(paths[:3])
        raise KeyboardInterrupt  # Ctrl-C after three objects

    monkeypatch.setattr(checkpoint_copy, "_copy_objects", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_copy.copy_checkpoint(src, dst, dst_options=opts)
    # What a kill in the middle of a streamed object leaves: a hidden upload part.
    open_store(dst, copy_dest.options).put("obj-5.bin.0a1b2c3d-0001.cloudckpt-part", b"p" * 99)
    monkeypatch.setattr(checkpoint_copy, "_copy_objects", real)
    second: list[str] = []

    def counting(ckpt, writer, paths, progress):
        second.extend(paths)
        real(ckpt, writer, paths, progress)

    monkeypatch.setattr(checkpoint_copy, "_copy_objects", counting)
    out = checkpoint_copy.copy_checkpoint(src, dst, dst_options=opts)
    assert sorted(second) == sorted(set(objects) - set(copied))  # only what was missing
    out.verify(deep=True)
    assert out.manifest.commit_id == src.manifest.commit_id
    left = keys(copy_dest, dst)
    assert not [k for k in left if "cloudckpt-part" in k or "cloudckpt-tmp" in k]
    assert CLAIM_NAME not in left


# ----------------------------------------------------------- 5: a typo in the scheme


def test_an_unknown_scheme_is_a_config_error(memory):
    import cloudckpt.dcp as cdcp

    with pytest.raises(ConfigError, match=r"unknown URL scheme s4://.*Did you mean s3://"):
        open_store("s4://bucket/run")
    with pytest.raises(ConfigError, match="unknown URL scheme"):
        cdcp.load({"w": torch.zeros(2)}, "s4://bucket/run/step-1")
    done = cli(memory, "ls", "s4://bucket/run")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "unknown URL scheme" in done.stderr


# -------------------------------------------- 7: a model of another shape, on load


def test_loading_into_another_shape_names_the_key_and_both_shapes(s3):
    import cloudckpt.dcp as cdcp

    saved = torch.nn.Sequential(torch.nn.Linear(4, 3))
    cdcp.save({"model": saved.state_dict()}, s3.uri("dcp"), storage_options=s3.options)
    other = torch.nn.Sequential(torch.nn.Linear(5, 3))
    try:
        cdcp.load({"model": other.state_dict()}, s3.uri("dcp"), storage_options=s3.options)
    except Exception as exc:  # noqa: BLE001 - the point: an ordinary Exception
        error: BaseException = exc
    else:
        pytest.fail("loading into another shape succeeded")
    assert isinstance(error, StateMismatchError)
    assert re.search(r"model\.0\.weight has shape \(3, 4\) in the checkpoint but \(3, 5\)",
                     str(error))
    mgr = CheckpointManager(s3.uri("run"), ManagerOptions(every_steps=1),
                            storage_options=s3.options)
    mgr.save(StepInfo(), {"model": saved.state_dict()}, rng=False)
    with pytest.raises(StateMismatchError, match=r"model\.0\.weight has shape \(3, 4\)"):
        mgr.restore({"model": other.state_dict()}, rng=False)


# ------------------------------------------------- 8: a bucket that does not exist


@pytest.fixture(params=["s3", "gcs"])
def cloud(request):
    return request.getfixturevalue(request.param)


def test_a_missing_bucket_is_reported_on_reads(cloud, capsys):
    scheme = cloud.root.split("://")[0]
    uri = f"{scheme}://no-such-bucket-{os.getpid()}/run"
    for read in (lambda: list_checkpoints(uri, cloud.options),
                 lambda: latest_checkpoint(uri, cloud.options),
                 lambda: open_checkpoint(f"{uri}/step-1", cloud.options)):
        with pytest.raises(BucketNotFoundError, match="no-such-bucket.* does not exist"):
            read()
    assert main([*opts_args(cloud), "ls", uri]) == 3
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------- 9: no credentials


def test_no_credentials_are_said_as_such(s3, gcs, tmp_path):
    empty = {"HOME": str(tmp_path), "AWS_CONFIG_FILE": str(tmp_path / "none"),
             "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
             "AWS_EC2_METADATA_DISABLED": "true"}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "GOOGLE_", "STORAGE_EMULATOR", "CLOUDSDK"))}
    env.update(empty)
    done = subprocess.run([sys.executable, "-m", "cloudckpt", "ls", s3.root, "-o",
                           f"endpoint_url={s3.options['endpoint_url']}"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 7, done.stderr
    assert "no credentials were found, so no request was sent" in done.stderr
    assert "refused" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "cloudckpt", "ls", gcs.root],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 7, done.stderr
    assert "no Google Cloud credentials were found" in done.stderr
    assert "GOOGLE_APPLICATION_CREDENTIALS" in done.stderr
    with pytest.raises(AccessDeniedError):
        from cloudckpt.storage.backends.gcs.options import no_credentials

        raise no_credentials("bucket")


# ------------------------------------------------------- 10: never a raw traceback


def test_push_with_a_bad_token_is_access_denied(memory, hub_server, capsys):
    commit(memory, "export", 1, {"config.json": b"{}", "model.safetensors": b"x" * 100},
           kind="hf")
    bad = ["push", memory.uri("export"), "org/model", "--endpoint", hub_server.endpoint]
    assert main([*bad, "--token", "hf_not_the_right_token"]) == 7
    err = capsys.readouterr().err
    assert "refused the request (HTTP 401" in err and "hf_not_the_right_token" not in err
    assert main([*bad, "--token", HUB_TOKEN]) == 0
    assert "org/model" in capsys.readouterr().out


def test_a_closed_pipe_ends_quietly(local):
    commit(local, "big", 1, {f"f-{i:05d}.bin": b"x" for i in range(3000)})
    proc = subprocess.Popen([sys.executable, "-m", "cloudckpt", "info", "--all",
                             local.uri("big")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(100)
    proc.stdout.close()  # as `| head` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == ""


def test_bad_storage_options_are_usage_errors(s3):
    o = [f"endpoint_url={s3.options['endpoint_url']}"]
    done = cli(s3, "-o", o[0], "-o", "max_concurrency=abc", "ls", s3.root)
    assert done.returncode == 2 and "max_concurrency must be a positive integer" in done.stderr
    done = cli(s3, "ls", s3.root, "-o", "endpoint=http://127.0.0.1:1")
    assert done.returncode == 2 and "did you mean 'endpoint_url'" in done.stderr
    for d in (done,):
        assert "Traceback" not in d.stderr


# ------------------------------------------------------------------- 12: the output


def test_ls_shows_what_an_uncommitted_prefix_holds(s3, capsys):
    commit(s3, "step-1", 1)
    torn_save(s3.uri("step-2"), s3.options, {"big.bin": os.urandom(300 * 1024)})
    # -o after the command works too
    assert main(["ls", s3.root, *opts_args(s3)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "uncommitted" in rows["step-2"]
    assert re.search(r"300\.\d KiB\s+2\s", rows["step-2"])  # the object and the claim
    assert re.search(r"\d\d:\d\d:\d\d [+-]\d{4}", rows["step-1"])  # a time with its zone


def test_info_lists_a_few_objects_unless_asked(local, capsys):
    commit(local, "many", 1, {f"f-{i:04d}.bin": b"x" for i in range(300)})
    assert main(["info", local.uri("many")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) < 40 and "280 more objects" in out[-1] and "--all" in out[-1]
    assert main(["info", "--all", local.uri("many")]) == 0
    assert len(capsys.readouterr().out.splitlines()) > 300


def test_download_is_labelled_and_plurals_read_right(local, tmp_path, capsys):
    commit(local, "one", 1, {"only.bin": b"x"})
    assert main(["download", local.uri("one"), str(tmp_path / "dl")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("download: ") and "(1 object," in out


def test_every_option_has_help_and_the_help_is_plain_text(capsys):
    parser = build_parser()
    seen = 0
    for action in parser._actions:
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict):  # the subcommands
            for sub in choices.values():
                for a in sub._actions:
                    subs = getattr(a, "choices", None)
                    if isinstance(subs, dict):
                        for conv in subs.values():
                            for c in conv._actions:
                                assert c.help, f"{conv.prog} {c.dest} has no help"
                                seen += 1
                    assert a.help, f"{sub.prog} {a.dest} has no help"
                    seen += 1
    assert seen > 50
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":class:" not in text and "141" in text


def test_wrong_argument_types_are_type_errors(memory):
    w = CheckpointWriter(memory.uri("t"))
    with pytest.raises(TypeError, match="mapping of path to bytes"):
        w.put_many([("a.bin", b"x")])
    with pytest.raises(TypeError, match="must be bytes"):
        w.put("a.bin", "text")
    with pytest.raises(TypeError, match="object paths are strings"):
        w.put(7, b"x")


def test_a_stock_dcp_checkpoint_is_pointed_to_adopt(s3, tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    stock = tmp_path / "stock"
    dcp.save({"w": torch.ones(4)}, storage_writer=FileSystemWriter(str(stock)), no_dist=True)
    store = open_store(s3.uri("stock"), s3.options)
    store.put_many({p.name: p.read_bytes() for p in stock.iterdir()})
    for command in ("info", "verify"):
        assert main([*opts_args(s3), command, s3.uri("stock")]) == 2
        assert f"cloudckpt adopt {s3.uri('stock')}" in capsys.readouterr().err


def test_docs_list_every_exit_code():
    from pathlib import Path

    from cloudckpt import cli as cli_module

    text = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", text, flags=re.M)}
    codes = {code for _, code in cli_module.EXIT_CODES} | {
        cli_module.EXIT_OK, cli_module.EXIT_INTERNAL, cli_module.EXIT_INTERRUPTED,
        cli_module.EXIT_PIPE}
    assert documented == codes


# ------------------------------------------------ found in review, each with a test


def test_a_claim_never_covers_data_cloudckpt_did_not_write(local, capsys):
    from cloudckpt import NotACheckpointError
    from cloudckpt.core.ownership import survey

    store = open_store(local.root, local.options)
    store.put("datasets/train.jsonl", b'{"x": 1}\n')
    with pytest.raises(NotACheckpointError, match="did not write"):
        CheckpointWriter(local.uri("datasets"), storage_options=local.options).put(
            "a.bin", b"a")
    assert keys(local, local.uri("datasets")) == ["train.jsonl"]  # no claim, no object
    commit(local, "run/step-1", 1)
    store.put("run/train.log", b"log")
    with pytest.raises(NotACheckpointError, match="root holding 1 committed checkpoint"):
        CheckpointWriter(local.uri("run"), storage_options=local.options).put("a.bin", b"a")
    # A stale claim at a run's top (left by an older release) does not make it a save.
    store.put(f"run/{CLAIM_NAME}", b'{"writer": "old", "abandoned": true}')
    assert survey(open_store(local.uri("run"), local.options)).kind == "root"
    assert main(["rm", "--force", local.uri("run")]) == 2
    assert main(["gc", "--yes", "--grace", "0", local.root]) == 0
    capsys.readouterr()
    assert store.get("run/train.log") == b"log" and store.get("datasets/train.jsonl")
    open_checkpoint(local.uri("run/step-1"), local.options).verify(deep=True)


def test_a_failed_adopt_leaves_the_objects_foreign(local, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint import FileSystemWriter

    import cloudckpt.dcp as cdcp
    from cloudckpt.core.gc import collect, find_garbage
    from cloudckpt.core.ownership import survey

    tdcp.save({"w": torch.ones(4)}, storage_writer=FileSystemWriter(str(tmp_path / "s")),
              no_dist=True)
    store = open_store(local.uri("stock"), local.options)
    store.put_many({p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()})
    before = keys(local, local.uri("stock"))

    def fail(self, manifest=None):
        self._claim.acquire()  # the claim is in place when the commit fails
        raise RuntimeError("manifest write failed")

    monkeypatch.setattr(CheckpointWriter, "commit", fail)
    with pytest.raises(RuntimeError):
        cdcp.adopt(local.uri("stock"), local.options)
    monkeypatch.undo()
    assert keys(local, local.uri("stock")) == before  # its claim went with it
    assert survey(store).kind == "foreign"
    collect(find_garbage(local.root, local.options, grace_seconds=0), local.options)
    assert keys(local, local.uri("stock")) == before
    cdcp.adopt(local.uri("stock"), local.options).verify(deep=True)


def test_deleting_a_checkpoint_leaves_what_it_does_not_list(s3, caplog):
    one = commit(s3, "step-1", 1)
    open_store(s3.uri("step-1"), s3.options).put("notes.txt", b"mine")
    inner = commit(s3, "step-1/backup", 1)  # e.g. cp step-1 step-1/backup
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert delete_checkpoint(s3.uri("step-1"), s3.options) == len(one) + 1
    assert "left 5 object(s)" in caplog.text
    assert open_store(s3.uri("step-1"), s3.options).get("notes.txt") == b"mine"
    assert open_checkpoint(s3.uri("step-1/backup"), s3.options).read_many(
        sorted(inner)) == inner


def test_a_save_below_is_not_a_leftover_of_the_root(local, s3, capsys):
    from cloudckpt import NotACheckpointError
    from cloudckpt.movement.checkpoint_copy import copy_checkpoint

    commit(s3, "src", 1)
    live = CheckpointWriter(local.uri("run/step-7"), step=7, storage_options=local.options)
    live.put("a.bin", b"a")  # a save under way further down: its claim, its object
    with pytest.raises(NotACheckpointError, match="unfinished save"):
        copy_checkpoint(s3.uri("src"), local.uri("run"), src_options=s3.options,
                        dst_options=local.options)
    assert main(["rm", "--force", local.uri("run")]) == 2
    capsys.readouterr()
    live.commit()  # untouched: it commits
    open_checkpoint(local.uri("run/step-7"), local.options).verify(deep=True)


def test_gc_leaves_a_save_written_to_since_it_was_found(local):
    from cloudckpt.core.gc import collect, find_garbage

    torn_save(local.uri("step-2"), local.options, {"a.bin": b"old"})
    old = os.path.getmtime(local.uri("step-2", "a.bin")) - 7200
    for name in os.listdir(local.uri("step-2")):
        os.utime(local.uri("step-2", name), (old, old))
    found = find_garbage(local.root, local.options, grace_seconds=3600)
    assert [g.uri for g in found] == [local.uri("step-2")]
    with CheckpointWriter(local.uri("step-2"), step=2, storage_options=local.options) as w:
        w.put("a.bin", b"the retry")  # takes the dead save over, still running ...
        assert collect(found, local.options) == 0  # ... when gc gets to it
    assert open_checkpoint(local.uri("step-2"), local.options).read("a.bin") == b"the retry"


def test_an_unfinished_save_is_deleted_only_with_its_claim_seized(local):
    from cloudckpt.core.deletion import delete_unfinished
    from cloudckpt.core.ownership import survey
    from cloudckpt.errors import CommitConflictError

    torn_save(local.uri("step-3"), local.options, {"a.bin": b"a"})
    store = open_store(local.uri("step-3"), local.options)
    seen = survey(store)
    retry = CheckpointWriter(store, step=3)
    retry.put("a.bin", b"retried")  # takes the claim over after the survey
    with pytest.raises(CommitConflictError, match="took .* over"):
        delete_unfinished(store, seen)
    retry.commit()
    assert open_checkpoint(store).read("a.bin") == b"retried"


def test_one_rank_refusing_state_stops_every_rank(tmp_path):
    from dist_run import run_ranks

    results = run_ranks("mistake_workers.refuse_on_one_rank", 2, str(tmp_path / "run"),
                        timeout=120, pg_timeout=60)
    assert results[1][0] == "ConfigError" and "per_rank['fn']" in results[1][1]
    assert results[0][0] == "ConfigError" and "rank 1" in results[0][1]
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").rglob("*.distcp"))


def test_a_bucket_probe_that_is_forbidden_is_not_an_error(s3, s3_server):
    from cloudckpt_testkit import FaultPlan, FaultProxy

    with FaultProxy(s3_server.endpoint) as proxy:
        proxy.set_plan(FaultPlan(permanent_status=403, methods=("HEAD",)))
        opts = {**s3.options, "endpoint_url": proxy.endpoint}
        assert list_checkpoints(s3.uri("fresh-run"), opts) == []  # a fresh run: nothing
        assert proxy.faults["permanent"] >= 1


def test_a_listing_racing_a_commit_shows_it_committed(local, monkeypatch):
    from cloudckpt.core import listing

    commit(local, "step-1", 1)
    real = listing.read_manifest_bytes
    calls = []

    def late(store, *a, **k):  # the first read misses the manifest that then lands
        calls.append(store.uri)
        if len(calls) == 1:
            raise FileNotFoundError(store.uri)
        return real(store, *a, **k)

    monkeypatch.setattr(listing, "read_manifest_bytes", late)
    infos = list_checkpoints(local.root, local.options, include_uncommitted=True)
    assert [(i.name, i.status) for i in infos] == [("step-1", "committed")]


def test_roll_pruning_never_touches_checkpoints_it_did_not_write(s3, tmp_path):
    from test_integration_roll import commit_checkpoint, config, roll_manager_uploader

    open_store(s3.uri("checkpoint-50"), s3.options).put("actor/model.pt", b"stock upload")
    up = roll_manager_uploader(config(s3, expected_uploads=2, max_ckpt_to_keep=1,
                                      torn_grace_seconds=0))
    commit_checkpoint(up, tmp_path, 100)
    assert open_store(s3.uri("checkpoint-50"), s3.options).get("actor/model.pt") == (
        b"stock upload")
    open_checkpoint(s3.uri("checkpoint-100"), s3.options).verify()


def test_an_unreadable_checkpoint_can_be_removed_by_force(local, capsys):
    commit(local, "step-1", 1)
    commit(local, "step-2", 2)
    open_store(local.uri("step-2"), local.options).put("cloudckpt-manifest.json", b"{oops")
    assert main(["rm", local.uri("step-2")]) == 1
    assert main(["rm", "--recursive", "--yes", local.root]) == 0  # step-1 goes, step-2 stays
    assert [k.split("/")[0] for k in keys(local, local.root)] == ["step-2"] * 4
    assert main(["rm", "--force", local.uri("step-2")]) == 0
    assert keys(local, local.root) == []
    capsys.readouterr()


def test_more_user_errors_have_their_exit_codes(s3, memory, hub_server, capsys):
    from cloudckpt import CheckpointNotFoundError, WorldSizeError
    from cloudckpt.cli import _report

    commit(memory, "export", 1, {"config.json": b"{}", "model.safetensors": b"x" * 100},
           kind="hf")
    assert main(["push", memory.uri("export"), "bad repo/id!", "--endpoint",
                 hub_server.endpoint, "--token", HUB_TOKEN]) == 2
    o = [f"endpoint_url={s3.options['endpoint_url']}"]
    assert main(["-o", o[0], "-o", "client_kwargs=notadict", "ls", s3.root]) == 2
    assert main(["-o", o[0], "-o", "anon=maybe", "ls", s3.root]) == 2
    assert main(["-o", o[0], "ls", "s3://Not_A_Valid_Bucket!/run"]) == 2
    assert _report(WorldSizeError("saved by 2 ranks")) == 2
    capsys.readouterr()
    ckpt = open_checkpoint(memory.uri("export"))
    with pytest.raises(CheckpointNotFoundError, match="not part of checkpoint"):
        ckpt.read("typo.json")


def test_a_writer_that_claims_again_after_failing_is_live_again(local):
    import json

    w = CheckpointWriter(local.uri("step-4"), storage_options=local.options)
    w.put("a.bin", b"a")
    w.abandon()
    store = open_store(local.uri("step-4"), local.options)
    assert json.loads(store.get(CLAIM_NAME))["abandoned"] is True
    w.put("b.bin", b"b")  # the same writer goes on: its claim must not say abandoned
    assert "abandoned" not in json.loads(store.get(CLAIM_NAME))
    w.commit()


def test_checking_state_does_not_serialise_tensors(monkeypatch):
    from cloudckpt.runtime.state import check_restorable

    def no_save(*a, **k):
        raise AssertionError("tensors were serialised to check them")

    monkeypatch.setattr(torch, "save", no_save)
    check_restorable("per_rank['x']", {"w": torch.zeros(1000), "step": 3, "ids": [1, 2]})
