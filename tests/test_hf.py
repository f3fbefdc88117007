"""Hugging Face exports: to S3, back into transformers, to a Hub server, from DCP."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from dist_run import run_ranks
from helpers import HUB_TOKEN

from cloudckpt import CorruptCheckpointError, hf, open_checkpoint, open_store
from cloudckpt.cli import main as cli
from cloudckpt.hf.convert import dcp_to_hf, dcp_to_pt
from cloudckpt.hf.hub import push_in_background, push_to_hub

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama causal LM built from a config, and a tokenizer trained locally."""
    warnings.simplefilter("ignore")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the quick brown fox jumps over the lazy dog"] * 20 + ["checkpoints in buckets"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=96, special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return model, tokenizer


def logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer("the lazy fox in buckets", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_export_to_s3_loads_with_transformers(s3, tiny, tmp_path, shard):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = tiny
    uri = s3.uri("export")
    kw = {"max_shard_size": shard} if shard else {}
    ckpt = hf.export(model, uri, tokenizer=tokenizer, storage_options=s3.options, **kw)
    weights = [f for f in ckpt.files if f.endswith(".safetensors")]
    if shard:
        assert len(weights) > 3 and "model.safetensors.index.json" in ckpt.files
        assert weights[0] == f"model-00001-of-{len(weights):05d}.safetensors"
    else:
        assert weights == ["model.safetensors"]
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(ckpt.files)
    ckpt.verify(deep=True)

    local = hf.download(uri, tmp_path / "dl", storage_options=s3.options)
    loaded = AutoModelForCausalLM.from_pretrained(str(local)).eval()
    loaded_tok = AutoTokenizer.from_pretrained(str(local))
    assert loaded_tok("checkpoints in buckets")["input_ids"] == tokenizer(
        "checkpoints in buckets")["input_ids"]
    assert torch.equal(logits(loaded, loaded_tok), logits(model, tokenizer))

    state = hf.load_state_dict(uri, storage_options=s3.options)
    assert "lm_head.weight" not in state  # tied to the embeddings: stored once
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in state)


def test_from_pretrained_caches_by_commit_and_download_skips_unchanged(s3, tiny, tmp_path,
                                                                         monkeypatch, caplog):
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny
    monkeypatch.setenv("CLOUDCKPT_CACHE", str(tmp_path / "cache"))
    uri = s3.uri("export")
    ckpt = hf.export(model, uri, tokenizer=tokenizer, dtype=torch.bfloat16,
                     storage_options=s3.options)
    loaded = hf.from_pretrained(AutoModelForCausalLM, uri, storage_options=s3.options)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    cached = tmp_path / "cache" / "hf" / ckpt.manifest.commit_id
    assert (cached / "model.safetensors").is_file()
    with caplog.at_level(logging.INFO, logger="cloudckpt"):
        hf.download(uri, cached, storage_options=s3.options)
    assert f"0 files fetched, {len(ckpt.files)} already present" in caplog.text
    (cached / "config.json").write_text("{}")  # a changed local file is fetched again
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cloudckpt"):
        hf.download(uri, cached, storage_options=s3.options)
    assert "1 files fetched" in caplog.text
    assert json.loads((cached / "config.json").read_text())["hidden_size"] == 32


def test_plain_state_dict_needs_a_config(memory):
    with pytest.raises(Exception, match="needs a config"):
        hf.export({"w": torch.ones(2)}, memory.uri("x"))
    ckpt = hf.export({"w": torch.ones(2), "v": torch.zeros(3, dtype=torch.int64)},
                     memory.uri("y"), config={"model_type": "toy"})
    assert hf.load_state_dict(ckpt)["v"].dtype == torch.int64


def test_push_to_hub_then_snapshot_download(hub_server, s3, tiny, tmp_path):
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = tiny
    uri = s3.uri("export")
    ckpt = hf.export(model, uri, tokenizer=tokenizer, max_shard_size="40KB",
                     storage_options=s3.options)
    url = push_to_hub(uri, "org/tiny-llama", token=HUB_TOKEN, storage_options=s3.options,
                      endpoint=hub_server.endpoint)
    assert url.startswith(hub_server.endpoint) and "org/tiny-llama" in url
    on_hub = hub_server.files("org/tiny-llama")
    pushed = {k: v for k, v in on_hub.items() if k != ".gitattributes"}
    assert set(pushed) == set(ckpt.files)  # exactly the manifest's files, not the manifest
    for name, data in pushed.items():
        assert data == ckpt.read(name)
    commit = hub_server.commits("org/tiny-llama")[-1]
    assert any(f.endswith(".safetensors") for f in commit["lfs"])  # big files went via LFS

    local = snapshot_download("org/tiny-llama", endpoint=hub_server.endpoint, token=HUB_TOKEN,
                              local_dir=tmp_path / "snap")
    for name in pushed:
        assert (Path(local) / name).read_bytes() == pushed[name]
    loaded = AutoModelForCausalLM.from_pretrained(local).eval()
    assert torch.equal(logits(loaded, AutoTokenizer.from_pretrained(local)),
                       logits(model, tokenizer))


def test_corrupt_export_is_refused_before_any_request(hub_server, s3, tiny):
    model, tokenizer = tiny
    uri = s3.uri("export")
    hf.export(model, uri, tokenizer=tokenizer, storage_options=s3.options)
    store = open_store(uri, s3.options)
    data = bytearray(store.get("model.safetensors"))
    data[-100] ^= 0x01
    store.put("model.safetensors", bytes(data))
    hub_server.requests.clear()
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        push_to_hub(uri, "org/bad", token=HUB_TOKEN, storage_options=s3.options,
                    endpoint=hub_server.endpoint)
    assert hub_server.requests == []
    job = push_in_background(uri, "org/bad", token=HUB_TOKEN, storage_options=s3.options,
                             endpoint=hub_server.endpoint)
    with pytest.raises(CorruptCheckpointError):
        job.result(timeout=60)
    assert job.status == "failed" and isinstance(job.error, CorruptCheckpointError)
    assert hub_server.requests == []


def test_background_push_and_cli_push(hub_server, s3, tiny, caplog):
    model, tokenizer = tiny
    uri = s3.uri("export")
    hf.export(model, uri, tokenizer=tokenizer, storage_options=s3.options)
    with caplog.at_level(logging.DEBUG):
        job = push_in_background(uri, "org/bg", token=HUB_TOKEN, storage_options=s3.options,
                                 endpoint=hub_server.endpoint)
        assert "/org/bg" in job.result(timeout=120) and job.status == "done"
    assert HUB_TOKEN not in caplog.text  # the token is never logged
    env = {**os.environ, **s3.env, "HF_ENDPOINT": hub_server.endpoint, "HF_TOKEN": HUB_TOKEN,
           "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "cloudckpt", "-v", "push", uri, "org/cli",
                          "--private", "--create-pr"], capture_output=True, text=True,
                         env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "discussions" in out.stdout
    assert HUB_TOKEN not in out.stdout + out.stderr
    assert "model.safetensors" in hub_server.files("org/cli", revision="refs/pr/1")


def test_dcp_from_two_ranks_converts_to_hf_and_pt(s3, tmp_path):
    uri, ref = s3.uri("dcp"), str(tmp_path / "ref.pt")
    run_ranks("dcp_workers.save_sharded", 2, uri, s3.options_json(), ref)
    expected = torch.load(ref, weights_only=True)["model"]
    out = dcp_to_hf(uri, s3.uri("hf"), config={"model_type": "toy-mlp"},
                    storage_options=s3.options)
    state = hf.load_state_dict(out)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in state)
    assert open_checkpoint(s3.uri("hf"), s3.options).metadata["converted_from"] == uri

    pt = tmp_path / "model.pt"
    base = ["-o", f"endpoint_url={s3.options['endpoint_url']}"]
    assert cli([*base, "convert", "dcp-to-pt", "--dcp_path", uri, "--output_path", str(pt)]) == 0
    loaded = torch.load(pt, weights_only=True)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in loaded)

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "toy-mlp"}))
    assert cli([*base, "convert", "dcp-to-hf", uri, s3.uri("hf16"), "--config", str(cfg),
                "--dtype", "bf16"]) == 0
    state16 = hf.load_state_dict(s3.uri("hf16"), storage_options=s3.options)
    assert all(v.dtype == torch.bfloat16 for v in state16.values())
    assert dcp_to_pt  # the function behind the CLI, also public
