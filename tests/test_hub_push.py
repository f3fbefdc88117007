"""A Hub push publishes exactly one HF export, at any size.

Over the test Hub server and moto S3: weight files already in the repo that the
export does not have are refused (or, with ``replace``, deleted in the same
commit), and a training or DCP checkpoint never reaches the Hub. A file above the
Hub's per-file limit is refused before any request; a push killed mid-upload and run
again sends only the objects the Hub lacks; a Hub that limits operations per commit
gets batches with the index last, and the repo never serves a mix of two models.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import HUB_TOKEN

from cloudckpt import (
    CheckpointManager,
    CheckpointWriter,
    CloudCkptError,
    CommitConflictError,
    ConfigError,
    ManagerOptions,
    StepInfo,
    hf,
    latest_checkpoint,
)
from cloudckpt import dcp as cloud_dcp
from cloudckpt.cli import main as cli
from cloudckpt.hf import exporting
from cloudckpt.hf.hub import PushOptions, push, push_in_background, push_to_hub

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::FutureWarning", "ignore::UserWarning")

REPO = "org/pushed"
#: Files of the repo that are not the model's: a push must leave them as they are.
OTHERS = {"README.md": b"# A model card\n", "notes.txt": b"kept",
          "older/model.safetensors": b"\x00" * 64}  # a subfolder: not what from_pretrained reads


def tiny(seed: int):
    """A tiny Llama (~90 KB of weights), so a 40KB shard size makes several shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.simplefilter("ignore")
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def push_kw(hub_server, s3) -> dict:
    return {"token": HUB_TOKEN, "storage_options": s3.options, "endpoint": hub_server.endpoint}


def seeded_repo(hub_server, s3, export_uri: str) -> None:
    """``REPO`` holding the export at ``export_uri`` and :data:`OTHERS`."""
    from huggingface_hub import CommitOperationAdd, HfApi

    push_to_hub(export_uri, REPO, **push_kw(hub_server, s3))
    HfApi(endpoint=hub_server.endpoint, token=HUB_TOKEN).create_commit(
        REPO, [CommitOperationAdd(p, data) for p, data in OTHERS.items()],
        commit_message="card and notes")


def hub_model(hub_server, tmp_path: Path, revision: str | None = None):
    """The repo as ``from_pretrained`` sees it: a snapshot downloaded from the Hub."""
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM

    snap = snapshot_download(REPO, revision=revision, endpoint=hub_server.endpoint,
                             token=HUB_TOKEN, cache_dir=tmp_path / "snapshots")
    return AutoModelForCausalLM.from_pretrained(snap).eval()


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_sharded_push_over_a_single_file_repo_needs_replace(hub_server, s3, tmp_path, caplog):
    old, new = tiny(1), tiny(0)
    hf.export(old, s3.uri("old"), storage_options=s3.options)
    ckpt = hf.export(new, s3.uri("new"), max_shard_size="40KB", storage_options=s3.options)
    assert "model.safetensors" not in ckpt.files and len(ckpt.files) > 4
    seeded_repo(hub_server, s3, s3.uri("old"))
    before = hub_server.commits(REPO)

    with pytest.raises(CommitConflictError, match="model.safetensors") as err:
        push_to_hub(s3.uri("new"), REPO, **push_kw(hub_server, s3))
    assert "replace=True" in str(err.value) and "--replace" in str(err.value)
    assert hub_server.commits(REPO) == before  # nothing committed, nothing uploaded

    with caplog.at_level(logging.INFO, logger="cloudckpt.hf.hub"):
        done = push(s3.uri("new"), REPO, PushOptions(replace=True), **push_kw(hub_server, s3))
    assert done.replaced == ("model.safetensors",)
    assert "replacing model.safetensors" in caplog.text
    commits = hub_server.commits(REPO)
    assert len(commits) == len(before) + 1 and done.url.endswith(commits[-1]["oid"])
    assert commits[-1]["deleted"] == ["model.safetensors"]  # in the same commit, nothing else
    held = hub_server.files(REPO)
    assert {p: held[p] for p in OTHERS} == OTHERS
    assert set(held) == {".gitattributes", *OTHERS, *ckpt.files}
    assert all(held[p] == ckpt.read(p) for p in ckpt.files)

    loaded = hub_model(hub_server, tmp_path)
    assert same_weights(loaded, new) and not same_weights(loaded, old)


def test_a_single_file_push_over_shards_names_every_stale_file(hub_server, s3):
    sharded = hf.export(tiny(0), s3.uri("sharded"), max_shard_size="40KB",
                        storage_options=s3.options)
    hf.export(tiny(1), s3.uri("single"), storage_options=s3.options)
    seeded_repo(hub_server, s3, s3.uri("sharded"))
    stale = sorted(p for p in sharded.files if p.startswith("model"))

    # The same export again: same names are simply overwritten, nothing is stale.
    assert push(s3.uri("sharded"), REPO, **push_kw(hub_server, s3)).replaced == ()
    with pytest.raises(CommitConflictError) as err:
        push_to_hub(s3.uri("single"), REPO, **push_kw(hub_server, s3))
    assert all(p in str(err.value) for p in stale)
    assert "model.safetensors.index.json" in stale
    job = push_in_background(s3.uri("single"), REPO, PushOptions(replace=True),
                             **push_kw(hub_server, s3))
    assert REPO in job.result(timeout=120)
    assert hub_server.commits(REPO)[-1]["deleted"] == stale
    held = hub_server.files(REPO)
    assert "model.safetensors" in held and not any(p in held for p in stale)
    assert {p: held[p] for p in OTHERS} == OTHERS
    with pytest.raises(TypeError):
        push_in_background(s3.uri("single"), REPO, replce=True)  # a typo fails at once
    with pytest.raises(ConfigError, match="no branch 'dev'"):
        push_to_hub(s3.uri("single"), REPO, revision="dev", **push_kw(hub_server, s3))


def test_a_commit_racing_the_push_makes_it_fail(hub_server, s3, monkeypatch):
    """The commit is made on the revision inspected: a change in between is a conflict,
    never a repo holding the racer's weights beside the export's."""
    from huggingface_hub import HfApi

    hf.export(tiny(0), s3.uri("export"), max_shard_size="40KB", storage_options=s3.options)
    HfApi(endpoint=hub_server.endpoint, token=HUB_TOKEN).create_repo(REPO)
    inspect = HfApi.model_info

    def inspect_then_race(self, *args, **kwargs):
        info = inspect(self, *args, **kwargs)
        HfApi(endpoint=hub_server.endpoint, token=HUB_TOKEN).upload_file(
            path_or_fileobj=b"\x00" * 64, path_in_repo="model.safetensors", repo_id=REPO)
        return info

    monkeypatch.setattr(HfApi, "model_info", inspect_then_race)
    with pytest.raises(CommitConflictError, match="changed on the Hub while pushing"):
        push_to_hub(s3.uri("export"), REPO, **push_kw(hub_server, s3))
    assert set(hub_server.files(REPO)) == {".gitattributes", "model.safetensors"}


def training_checkpoint(s3) -> str:
    """A CheckpointManager save: model and optimizer DCP shards, RNG and step state."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with CheckpointManager(s3.uri("run"), ManagerOptions(every_steps=1),
                           storage_options=s3.options) as mgr:
        mgr.save(StepInfo(), {"model": model.state_dict(), "optim": opt.state_dict()})
    return latest_checkpoint(s3.uri("run"), s3.options).uri


def test_training_and_dcp_checkpoints_never_reach_the_hub(hub_server, s3):
    uris = {"a training checkpoint": training_checkpoint(s3), "a DCP checkpoint": s3.uri("dcp")}
    cloud_dcp.save({"w": torch.arange(6.0)}, s3.uri("dcp"), storage_options=s3.options)
    for what, uri in uris.items():
        hub_server.requests.clear()
        with pytest.raises(ConfigError) as err:
            push_to_hub(uri, REPO, replace=True, **push_kw(hub_server, s3))
        message = str(err.value)
        assert f"{uri} is {what}" in message and "not a Hugging Face export" in message
        assert f"cloudckpt convert dcp-to-hf {uri} DST" in message
        job = push_in_background(uri, REPO, **push_kw(hub_server, s3))
        with pytest.raises(ConfigError):
            job.result(timeout=60)
        assert hub_server.requests == []  # no repo created, nothing uploaded, no commit
    with pytest.raises(KeyError):
        hub_server.files(REPO)


def test_an_export_without_config_or_with_a_broken_index_is_refused(hub_server, s3):
    shard = hf.export({"w": torch.ones(3)}, s3.uri("base"), config={"model_type": "toy"},
                      storage_options=s3.options).read("model.safetensors")
    broken = {
        "no-config": {"model.safetensors": shard},
        "no-weights": {"config.json": b"{}", "tokenizer.json": b"{}"},
        "bad-index": {"config.json": b"{}", "model-00001-of-00002.safetensors": shard,
                      "model.safetensors.index.json": json.dumps({"weight_map": {
                          "w": "model-00001-of-00002.safetensors",
                          "v": "model-00002-of-00002.safetensors"}}).encode()},
    }
    for name, objects in broken.items():
        with CheckpointWriter(s3.uri(name), kind=hf.KIND, storage_options=s3.options) as w:
            w.put_many(objects)
    hub_server.requests.clear()
    for name, needle in (("no-config", "without config.json"), ("no-weights", "weights"),
                         ("bad-index", "model-00002-of-00002.safetensors")):
        with pytest.raises(ConfigError, match=needle):
            push_to_hub(s3.uri(name), REPO, **push_kw(hub_server, s3))
    assert hub_server.requests == []


def test_cli_refuses_stale_weights_with_exit_5_and_replaces_them(hub_server, s3, capsys):
    hf.export(tiny(1), s3.uri("old"), storage_options=s3.options)
    hf.export(tiny(0), s3.uri("new"), max_shard_size="40KB", storage_options=s3.options)
    seeded_repo(hub_server, s3, s3.uri("old"))
    base = ["-o", f"endpoint_url={s3.options['endpoint_url']}", "push", s3.uri("new"), REPO,
            "--endpoint", hub_server.endpoint, "--token", HUB_TOKEN]
    capsys.readouterr()

    assert cli(base) == 5
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "--replace" in err
    assert "model.safetensors" in hub_server.files(REPO)

    assert cli([*base, "--replace"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("replaced model.safetensors ")
    assert out[-1].startswith(hub_server.endpoint) and REPO in out[-1]
    assert "model.safetensors" not in hub_server.files(REPO)
    assert hub_server.files(REPO)["README.md"] == OTHERS["README.md"]

    assert cli([*base[:3], training_checkpoint(s3), *base[4:], "--replace"]) == 2
    assert "convert dcp-to-hf" in capsys.readouterr().err


def cli_args(hub_server, s3, uri: str, *extra: str) -> list[str]:
    return ["-o", f"endpoint_url={s3.options['endpoint_url']}", "push", uri, REPO,
            "--endpoint", hub_server.endpoint, "--token", HUB_TOKEN, *extra]


def sha256s(ckpt, paths) -> dict[str, str]:
    return {hashlib.sha256(ckpt.read(p)).hexdigest(): p for p in paths}


def test_a_push_killed_mid_upload_sends_only_the_missing_objects_when_run_again(
        hub_server, s3, tmp_path, capsys):
    model = tiny(0)
    ckpt = hf.export(model, s3.uri("export"), max_shard_size="16KB", storage_options=s3.options)
    shards = sha256s(ckpt, [p for p in ckpt.files if p.endswith(".safetensors")])
    assert len(shards) == 8
    hub_server.hold_lfs_uploads(after=3)  # then the uploads wait, unanswered, for the kill
    child = subprocess.Popen([sys.executable, "-m", "cloudckpt",
                              *cli_args(hub_server, s3, s3.uri("export"))],
                             env={**os.environ, **s3.env}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (hub_server.held_lfs_uploads and len(hub_server.lfs_objects(REPO)) == 3):
            assert child.poll() is None, child.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the push never reached its LFS uploads"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    hub_server.release_lfs_uploads()  # the held uploads die with the client: nothing stored
    first = set(hub_server.lfs_objects(REPO))
    assert len(first) == 3 and first <= set(shards)
    assert [c["title"] for c in hub_server.commits(REPO)] == ["initial commit"]
    assert set(hub_server.files(REPO)) == {".gitattributes"}  # nothing committed yet

    received = hub_server.lfs_uploads()
    assert cli(cli_args(hub_server, s3, s3.uri("export"))) == 0
    assert hub_server.lfs_uploads() - received == len(shards) - 3  # exactly the missing ones
    assert set(hub_server.lfs_objects(REPO)) == set(shards)
    url = capsys.readouterr().out.splitlines()[-1]
    commits = hub_server.commits(REPO)
    assert len(commits) == 2 and url.endswith(commits[-1]["oid"])
    assert set(commits[-1]["added"]) == set(ckpt.files)  # one commit, every file
    assert all(hub_server.files(REPO)[p] == ckpt.read(p) for p in ckpt.files)
    assert same_weights(hub_model(hub_server, tmp_path), model)


def test_a_file_above_the_hub_limit_is_refused_before_any_request(hub_server, s3, caplog):
    from cloudckpt_testkit import HubServer

    ckpt = hf.export(tiny(0), s3.uri("export"), max_shard_size="40KB",
                     storage_options=s3.options)
    sizes = {p: ckpt.entry(p).size for p in ckpt.files if p.endswith(".safetensors")}
    biggest = max(sizes, key=sizes.get)
    hub_server.requests.clear()
    with pytest.raises(ConfigError) as err:
        push(s3.uri("export"), REPO, PushOptions(max_file_size=sizes[biggest] - 1),
             **push_kw(hub_server, s3))
    message = str(err.value)
    assert f"{biggest} is {sizes[biggest]} bytes" in message
    assert f"limit of {sizes[biggest] - 1} bytes" in message and "nothing was pushed" in message
    assert "max_shard_size" in message and "cannot be split" not in message
    # A limit below the largest tensor (the tied embedding, 96 x 32 floats): no shard size helps.
    with pytest.raises(ConfigError, match="'model.embed_tokens.weight' alone is 12288 bytes.*"
                                          "cannot be split across shards"):
        push(s3.uri("export"), REPO, PushOptions(max_file_size=12287),
             **push_kw(hub_server, s3))
    assert hub_server.requests == []  # no repo created, nothing sent
    with pytest.raises(KeyError):
        hub_server.files(REPO)

    # A Hub whose limit is below ours: its batch answer refuses the object, nothing is sent.
    with HubServer(token=HUB_TOKEN, max_file_size=sizes[biggest] - 1) as strict:
        with pytest.raises(ConfigError, match=f"refuses {biggest} .*File too large.*"
                                              "smaller max_shard_size"):
            push(s3.uri("export"), REPO, token=HUB_TOKEN, storage_options=s3.options,
                 endpoint=strict.endpoint)
        assert strict.lfs_uploads() == 0
        assert set(strict.files(REPO)) == {".gitattributes"}


def test_export_keeps_every_file_below_the_hub_limit(s3, monkeypatch, caplog):
    """Shards are closed before a file, header included, would pass the limit, whatever
    max_shard_size asks; a tensor above it is refused by name."""
    limit = 8100
    monkeypatch.setattr(exporting, "HUB_FILE_LIMIT", limit)
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(500) for i in range(4)}  # 8000 bytes of tensors in all
    with caplog.at_level(logging.WARNING, logger="cloudckpt.hf"):
        ckpt = hf.export(state, s3.uri("capped"), config={"model_type": "toy"},
                         max_shard_size="5GB", storage_options=s3.options)
    assert "above the Hub's limit" in caplog.text
    weights = [p for p in ckpt.files if p.endswith(".safetensors")]
    assert len(weights) == 2 and all(ckpt.entry(p).size <= limit for p in weights)
    loaded = hf.load_state_dict(s3.uri("capped"), s3.options)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    with pytest.raises(ConfigError, match="tensor 'big' is 8400 bytes.*cannot be split"):
        hf.export({"small": torch.ones(4), "big": torch.zeros(2100)}, s3.uri("too-big"),
                  config={"model_type": "toy"}, storage_options=s3.options)
    with pytest.raises(CloudCkptError):
        hf.load_state_dict(s3.uri("too-big"), s3.options)  # nothing was committed there


def test_a_hub_that_limits_operations_per_commit_gets_batches_index_last(
        hub_server, s3, tmp_path, capsys, caplog):
    from cloudckpt_testkit import HubServer

    old, new = tiny(1), tiny(0)
    hf.export(old, s3.uri("old"), storage_options=s3.options)  # one model.safetensors
    ckpt = hf.export(new, s3.uri("new"), max_shard_size="40KB", storage_options=s3.options)
    index = "model.safetensors.index.json"
    with HubServer(token=HUB_TOKEN, max_commit_operations=2) as hub:
        kw = {"token": HUB_TOKEN, "storage_options": s3.options, "endpoint": hub.endpoint}
        # model.safetensors + config last
        push(s3.uri("old"), REPO, PushOptions(files_per_commit=2), **kw)
        before = hub.commits(REPO)
        assert [c["added"] for c in before[1:]] == [["generation_config.json"],
                                                    ["config.json", "model.safetensors"]]

        # Four shards' operations and a delete in one commit: refused, the repo unchanged.
        with pytest.raises(ConfigError, match="--files-per-commit N"):
            push(s3.uri("new"), REPO, PushOptions(replace=True), **kw)
        assert hub.commits(REPO) == before
        uploaded = hub.lfs_uploads()  # the shards went up before the refused commit

        base = cli_args(hub, s3, s3.uri("new"), "--replace", "--files-per-commit", "2")
        capsys.readouterr()
        with caplog.at_level(logging.INFO, logger="cloudckpt.hf"):
            assert cli(base) == 0
        assert hub.lfs_uploads() == uploaded  # nothing sent again
        assert "3 of 4 files already on the Hub" in caplog.text  # the shards; not the index
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "replaced model.safetensors (deleted in the last commit: the export " \
                         "does not have it)"
        made = hub.commits(REPO)[len(before):]
        assert out[1:] == [f"{hub.endpoint}/{REPO}/commit/{c['oid']}" for c in made]
        assert len(made) == 3 and [c["parents"] for c in made] == [
            [before[-1]["oid"]], [made[0]["oid"]], [made[1]["oid"]]]
        assert made[-1]["added"] == [index] and made[-1]["deleted"] == ["model.safetensors"]
        for commit in made[:-1]:  # until the last commit, the old model, whole
            held = hub.files(REPO, commit["oid"])
            assert index not in held and "model.safetensors" in held
        assert same_weights(hub_model(hub, tmp_path, made[0]["oid"]), old)
        assert set(hub.files(REPO)) == {".gitattributes", *ckpt.files}
        assert same_weights(hub_model(hub, tmp_path), new)

        # The same names with other weights: the early commits would mix old and new shards
        # under the old index, so the first takes the index down and the last brings it back.
        hf.export(old, s3.uri("again"), max_shard_size="40KB", storage_options=s3.options)
        seen = len(hub.commits(REPO))
        done = push(s3.uri("again"), REPO, PushOptions(files_per_commit=2), **kw)
        made = hub.commits(REPO)[seen:]
        assert made[0]["deleted"] == [index] and made[-1]["added"] == [index]
        assert all(index not in hub.files(REPO, c["oid"]) for c in made[:-1])
        assert done.commits == tuple(f"{hub.endpoint}/{REPO}/commit/{c['oid']}" for c in made)
        assert done.url == done.commits[-1]
        assert same_weights(hub_model(hub, tmp_path), old)

        # The index and config.json of a fresh repo must land together: one operation per
        # commit cannot do it, and that is said before anything is uploaded.
        with pytest.raises(ConfigError, match="files_per_commit=1 is too few.*at least 2"):
            push(s3.uri("new"), "org/other", PushOptions(files_per_commit=1), **kw)
        assert hub.lfs_objects("org/other") == {}
        assert set(hub.files("org/other")) == {".gitattributes"}
        assert push(s3.uri("again"), REPO, PushOptions(files_per_commit=2), **kw).commits == ()


def test_upload_progress_bars_show_on_a_terminal_only(hub_server, s3, capsys, monkeypatch):
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled

    hf_tqdm = sys.modules["huggingface_hub.utils.tqdm"]
    for where in (constants, hf_tqdm):  # as if HF_HUB_DISABLE_PROGRESS_BARS were unset
        monkeypatch.setattr(where, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    hf.export(tiny(0), s3.uri("export"), max_shard_size="40KB", storage_options=s3.options)
    assert not are_progress_bars_disabled()
    capsys.readouterr()
    assert cli(cli_args(hub_server, s3, s3.uri("export"))) == 0  # stderr is not a terminal
    assert "LFS files" not in capsys.readouterr().err
    assert not are_progress_bars_disabled()  # as it was before the push

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    args = cli_args(hub_server, s3, s3.uri("export"))
    args[args.index(REPO)] = "org/second"  # a fresh repo: every object goes up again
    assert cli(args) == 0
    assert "Upload 3 LFS files" in capsys.readouterr().err
