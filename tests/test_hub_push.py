"""A Hub push publishes exactly one HF export (issue 22, finding 4).

Over the test Hub server and moto S3: weight files already in the repo that the
export does not have are refused (or, with ``replace``, deleted in the same
commit), and a training or DCP checkpoint never reaches the Hub.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from helpers import HUB_TOKEN

from cloudckpt import (
    CheckpointManager,
    CheckpointWriter,
    CommitConflictError,
    ConfigError,
    ManagerOptions,
    StepInfo,
    hf,
    latest_checkpoint,
)
from cloudckpt import dcp as cloud_dcp
from cloudckpt.cli import main as cli
from cloudckpt.hf.hub import push, push_in_background, push_to_hub

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


def hub_model(hub_server, tmp_path: Path):
    """The repo as ``from_pretrained`` sees it: a snapshot downloaded from the Hub."""
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM

    snap = snapshot_download(REPO, endpoint=hub_server.endpoint, token=HUB_TOKEN,
                             cache_dir=tmp_path / "snapshots")
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
        done = push(s3.uri("new"), REPO, replace=True, **push_kw(hub_server, s3))
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
    job = push_in_background(s3.uri("single"), REPO, replace=True, **push_kw(hub_server, s3))
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
