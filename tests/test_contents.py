"""Looking inside checkpoints without downloading them: ``inspect`` and ``diff`` read
metadata only, partial loads read only the tensors asked for; counted by a
request-logging proxy in front of moto, and run over S3, GCS and local paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cloudckpt_testkit import FaultProxy
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as torch_dcp_save

import cloudckpt.dcp as cdcp
from cloudckpt import CheckpointManager, ManagerOptions, StepInfo, open_checkpoint, open_store
from cloudckpt.cli import main
from cloudckpt.contents import diff, list_contents
from cloudckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from cloudckpt.hf import export, load_tensors
from cloudckpt.hf.lazy import HEADER_PROBE, open_export
from cloudckpt.training.staging import upload_dir

#: 64 tensors of 1 MiB: big enough that metadata is well under 1% of the bytes.
N, ROWS, COLS = 64, 512, 512


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.weight": torch.randn(ROWS, COLS, generator=g) for i in range(N)}


def _nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@pytest.fixture
def proxied(s3, s3_server):
    """The S3 backend's options pointed at a request-logging proxy in front of moto."""
    with FaultProxy(s3_server.endpoint) as proxy:
        yield proxy, {**s3.options, "endpoint_url": proxy.endpoint}


def _cli_options(options) -> list[str]:
    return [a for k in ("endpoint_url", "key", "secret") for a in ("-o", f"{k}={options[k]}")]


def _tensor_gets(proxy, suffix: str) -> list[str]:
    return [r.target for r in proxy.request_log if r.method == "GET" and suffix in r.target]


# ------------------------------------------------------------------ inspect


@pytest.mark.parametrize("fmt", ["dcp", "hf"])
def test_inspect_reads_under_one_percent_of_the_bytes(s3, proxied, capsys, fmt):
    proxy, via_proxy = proxied
    state = _state()
    uri = s3.uri(fmt)
    if fmt == "dcp":
        cdcp.save({"model": {k.removeprefix("model."): v for k, v in state.items()},
                   "optimizer": {"step": 7}}, uri, storage_options=s3.options)
    else:
        export(state, uri, config={"model_type": "toy"}, max_shard_size="16MB",
               storage_options=s3.options)
    proxy.reset_counters()
    assert main(["inspect", uri, "--json", *_cli_options(via_proxy)]) == 0
    doc = json.loads(capsys.readouterr().out)
    total = open_checkpoint(uri, s3.options).total_size
    assert proxy.bytes_out <= 0.01 * total, (proxy.bytes_out, total)
    tensors = {t["name"]: t for t in doc["tensors"]}
    for name, t in state.items():
        assert tensors[name]["shape"] == list(t.shape) and tensors[name]["dtype"] == "float32"
        assert tensors[name]["bytes"] == t.numel() * 4
    assert doc["totals"]["model"] == {"tensors": N, "bytes": _nbytes(state)}
    if fmt == "dcp":
        assert tensors["optimizer.step"]["format"] == "dcp-bytes"
        assert not _tensor_gets(proxy, ".distcp")
    else:  # only the heads of the shards, one probe each
        assert len({t["files"][0] for t in doc["tensors"]}) == 5
        assert proxy.bytes_out <= 5 * HEADER_PROBE + 64 * 1024


def test_inspect_a_training_checkpoint_shows_parts_totals_and_state_files(s3, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    mgr = CheckpointManager(s3.root, ManagerOptions(every_steps=1), storage_options=s3.options)
    mgr.save(StepInfo(global_step=3), {"model": model.state_dict(),
                                       "optimizer": opt.state_dict()})
    mgr.close()
    uri = s3.uri("step-3")
    c = list_contents(uri, s3.options)
    assert c.kind == "training" and c.step == 3
    keys = {e.key: e for e in c.entries}
    assert keys["model/model.0.weight"].shape == (16, 8)
    assert keys["model/optimizer.state.0.exp_avg"].shape == (16, 8)
    totals = c.totals()
    assert totals["model"]["tensors"] == 4 and totals["model"]["bytes"] == 4 * (
        16 * 8 + 16 + 4 * 16 + 4)
    assert "optimizer" in totals
    assert {f.path for f in c.others} >= {"state/shared.bin"}
    assert main(["inspect", uri, "model/model.0.*", *_cli_options(s3.options)]) == 0
    out = capsys.readouterr().out
    assert "model/model.0.weight" in out and "model/model.1.weight" not in out
    assert "[16, 8]" in out and "2 tensors" in out


# --------------------------------------------------------------------- diff


def test_diff_reads_no_tensor_bytes_and_values_reads_only_the_changed(s3, proxied, capsys):
    proxy, via_proxy = proxied
    a = _state()
    b = dict(a)
    b["model.layers.3.weight"] = a["model.layers.3.weight"] * 1.5
    b["model.layers.9.weight"] = a["model.layers.9.weight"].to(torch.bfloat16)
    b["model.extra"] = torch.ones(4)
    del b["model.layers.60.weight"]
    for name, state in (("a", a), ("b", b)):
        cdcp.save(state, s3.uri(name), storage_options=s3.options)
    proxy.reset_counters()
    assert main(["diff", s3.uri("a"), s3.uri("b"), "--json", *_cli_options(via_proxy)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not _tensor_gets(proxy, ".distcp")  # checksums from the manifests only
    assert [e["name"] for e in doc["added"]] == ["model.extra"]
    assert [e["name"] for e in doc["removed"]] == ["model.layers.60.weight"]
    assert [(e["name"], e["b"]["dtype"]) for e in doc["retyped"]] == [
        ("model.layers.9.weight", "bfloat16")]
    assert [e["name"] for e in doc["changed"]] == ["model.layers.3.weight"]
    assert doc["unchanged"] == N - 3 and not doc["unknown"] and not doc["same"]

    proxy.reset_counters()
    assert main(["diff", s3.uri("a"), s3.uri("b"), "--values", "--exit-code",
                 *_cli_options(via_proxy)]) == 1
    out = capsys.readouterr().out
    delta = (a["model.layers.3.weight"] * 0.5).abs().max().item()
    rel = delta / (a["model.layers.3.weight"] * 1.5).abs().max().item()
    assert f"M model.layers.3.weight  max abs {delta:.6g}, max rel {rel:.6g}" in out
    one = ROWS * COLS * 4
    metadata = sum(open_checkpoint(s3.uri(n), s3.options).entry(".metadata").size
                   for n in "ab")
    assert proxy.bytes_out <= 2 * 1.2 * one + 2 * metadata + 64 * 1024, proxy.bytes_out


def test_diff_of_layouts_with_file_checksums_only_names_the_files_then_values_tell(
        s3, tmp_path, capsys):
    """Another tool's layout (torch's own DCP writer, safetensors' own writer, a pickle):
    no per-item checksums, so a pair in files that differ is unknown until read."""
    def layout(root, w, heads, note):
        torch_dcp_save({"w": w}, storage_writer=FileSystemWriter(str(root / "dcp")))
        save_file(heads, str(root / "head.safetensors"))
        torch.save({"note": note}, root / "extra.pt")
        return root

    w, head, bias = torch.randn(32, 8), torch.randn(4, 8), torch.randn(4)
    for name, ww, heads, note in (("a", w, {"head.weight": head}, 1),
                                  ("b", w + 0.25, {"head.weight": head, "head.bias": bias}, 2)):
        (tmp_path / name).mkdir()
        upload_dir(layout(tmp_path / name, ww, heads, note), s3.uri(name),
                   storage_options=s3.options, kind="generic")
    c = list_contents(s3.uri("a"), s3.options)
    assert {e.key: e.shape for e in c.entries} == {"dcp/w": (32, 8), "head.weight": (4, 8)}
    assert [f.path for f in c.others] == ["extra.pt"]
    d = diff(s3.uri("a"), s3.uri("b"), storage_options=s3.options)
    assert [b.key for _, b in d.unknown] == ["dcp/w", "head.weight"]
    assert [e.key for e in d.added] == ["head.bias"]
    assert d.unknown_files() == ["dcp/__0_0.distcp", "head.safetensors"]
    assert d.files_changed == ["extra.pt"]
    # Values: the safetensors pair is read and found equal; torch's own DCP files carry
    # no item checksums, so a verified read of one item is impossible: it stays unknown.
    d = diff(s3.uri("a"), s3.uri("b"), storage_options=s3.options, values=True)
    assert [b.key for _, b in d.unchanged] == ["head.weight"]
    assert [b.key for _, b in d.unknown] == ["dcp/w"] and not d.changed
    assert main(["diff", s3.uri("a"), s3.uri("b"), *_cli_options(s3.options)]) == 0
    out = capsys.readouterr().out
    assert "? dcp/w" in out and "+ head.bias" in out and "file changed: extra.pt" in out


# ------------------------------------------------------------- partial loads


def test_a_partial_dcp_load_of_one_tensor_reads_only_its_bytes(s3, proxied):
    proxy, via_proxy = proxied
    state = _state()
    cdcp.save(state, s3.uri("dcp"), storage_options=s3.options)
    ckpt = open_checkpoint(s3.uri("dcp"), s3.options)
    proxy.reset_counters()
    one = {"model.layers.17.weight": torch.empty(ROWS, COLS)}
    cdcp.load(one, s3.uri("dcp"), storage_options=via_proxy)
    assert torch.equal(one["model.layers.17.weight"], state["model.layers.17.weight"])
    meta = ckpt.entry(".metadata").size + len(ckpt.manifest.to_json())
    assert proxy.bytes_out <= 1.2 * ROWS * COLS * 4 + meta, proxy.bytes_out


def test_load_tensors_of_an_hf_export_reads_only_their_byte_ranges(s3, proxied):
    proxy, via_proxy = proxied
    state = _state()
    export(state, s3.uri("hf"), config={"model_type": "toy"}, max_shard_size="24MB",
           storage_options=s3.options)
    proxy.reset_counters()
    got = load_tensors(s3.uri("hf"), ["model.layers.40.weight"], via_proxy)
    assert list(got) == ["model.layers.40.weight"]
    assert torch.equal(got["model.layers.40.weight"], state["model.layers.40.weight"])
    ckpt = open_checkpoint(s3.uri("hf"), s3.options)
    shards = [p for p in ckpt.files if p.endswith(".safetensors")]
    index = json.loads(ckpt.read("model.safetensors.index.json"))
    holder = index["weight_map"]["model.layers.40.weight"]
    assert len(shards) == 3 and {t.split("?")[0].rsplit("/", 1)[1] for t in _tensor_gets(
        proxy, ".safetensors")} == {holder, "model.safetensors.index.json"}  # one header
    budget = 1.2 * ROWS * COLS * 4 + HEADER_PROBE + len(ckpt.manifest.to_json()) + len(
        json.dumps(index)) * 2
    assert proxy.bytes_out <= budget, proxy.bytes_out
    with open_export(s3.uri("hf"), via_proxy) as reader:
        assert len(reader.keys()) == N
        assert reader.select(["model.layers.6?.weight"]) == [
            f"model.layers.{i}.weight" for i in range(60, 64)]
    with pytest.raises(CheckpointNotFoundError, match="no tensor .*model.layers.99"):
        load_tensors(s3.uri("hf"), ["model.layers.99.weight"], s3.options)


# ------------------------------------------------------- every backend, errors


@pytest.mark.parametrize("where", ["local", "s3", "gcs", "azure"])
def test_inspect_diff_and_partial_loads_over_each_backend(request, where):
    be = request.getfixturevalue(where)
    small = {f"model.l{i}.weight": torch.randn(16, 8) for i in range(6)}
    export(small, be.uri("hf1"), config={"model_type": "toy"}, max_shard_size="1KB",
           storage_options=be.options)
    changed = {**small, "model.l2.weight": small["model.l2.weight"] + 1}
    export(changed, be.uri("hf2"), config={"model_type": "toy"}, max_shard_size="1KB",
           storage_options=be.options)
    c = list_contents(be.uri("hf1"), be.options)
    assert {e.name: e.shape for e in c.entries} == {k: (16, 8) for k in small}
    d = diff(be.uri("hf1"), be.uri("hf2"), storage_options=be.options)
    assert [b.key for _, b in d.changed] == ["model.l2.weight"] and not d.unknown  # checksums
    assert len(d.unchanged) == 5
    d = diff(be.uri("hf1"), be.uri("hf2"), storage_options=be.options, values=True)
    assert [b.key for _, b in d.changed] == ["model.l2.weight"]
    assert d.values["model.l2.weight"].max_abs == pytest.approx(1.0)
    got = load_tensors(be.uri("hf2"), ["model.l2.*"], be.options)
    assert torch.equal(got["model.l2.weight"], changed["model.l2.weight"])
    cdcp.save(small, be.uri("dcp"), storage_options=be.options)
    part = {"model.l4.weight": torch.empty(16, 8)}
    cdcp.load(part, be.uri("dcp"), storage_options=be.options)
    assert torch.equal(part["model.l4.weight"], small["model.l4.weight"])


def test_inspect_errors_are_clear_and_have_their_exit_codes(s3, capsys):
    opts = _cli_options(s3.options)
    assert main(["inspect", s3.uri("nothing-here"), *opts]) == 3
    assert "no checkpoint" in capsys.readouterr().err.lower()
    export({"w": torch.randn(8, 8)}, s3.uri("hf"), config={"model_type": "toy"},
           storage_options=s3.options)
    ckpt = open_checkpoint(s3.uri("hf"), s3.options)
    raw = bytearray(ckpt.read("model.safetensors"))
    raw[0:8] = (10**12).to_bytes(8, "little")  # a header longer than the file
    open_store(s3.uri("hf"), s3.options).put("model.safetensors", bytes(raw))
    assert main(["inspect", s3.uri("hf"), *opts]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "not a valid safetensors file" in err


def test_the_inspect_command_runs_as_a_process(s3):
    export({"w": torch.randn(8, 8)}, s3.uri("hf"), config={"model_type": "toy"},
           storage_options=s3.options)
    out = subprocess.run([sys.executable, "-m", "cloudckpt", "inspect", s3.uri("hf"),
                          *_cli_options(s3.options)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **s3.env})
    assert out.returncode == 0, out.stderr
    assert "w  " in out.stdout and "[8, 8]" in out.stdout and "float32" in out.stdout


def test_a_corrupt_tensor_read_alone_is_caught_by_its_own_checksum(s3):
    state = {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}
    export(state, s3.uri("hf"), config={"model_type": "toy"}, storage_options=s3.options)
    with open_export(s3.uri("hf"), s3.options) as reader:
        span = reader.span("b")
    raw = bytearray(open_checkpoint(s3.uri("hf"), s3.options).read("model.safetensors"))
    raw[span.start + 100] ^= 0xFF  # one byte of b; a stays intact
    open_store(s3.uri("hf"), s3.options).put("model.safetensors", bytes(raw))
    assert torch.equal(load_tensors(s3.uri("hf"), ["a"], s3.options)["a"], state["a"])
    with pytest.raises(CorruptCheckpointError, match="tensor b in model.safetensors .* corrupt"):
        load_tensors(s3.uri("hf"), ["b"], s3.options)
