"""RLinf's own code drives cloudckpt: its ``Checkpoint`` (checkpoint.py) saves and
loads, its ``convert_dcp_to_pt.py`` converts, its ``check_progress`` decides saves.

Both directions are bit-exact (model, optimizer, lr schedulers, RNG, and the same
further steps): a step cloudckpt wrote to S3 (moto) is downloaded with ``cloudckpt
download`` and loaded by RLinf; a step RLinf wrote locally goes into the bucket with
one command and cloudckpt resumes it; a stock step already in a GCS bucket
(fake-gcs-server) is adopted with one command and resumes.

Stand-ins (RLinf's actor needs CUDA and a Ray cluster): FSDP2 ``fully_shard`` on
the CPU with 2 gloo ranks (see rlinf_ranks.py), and a plain module in one process
where sharding does not matter (GCS, local disk).
"""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import types
from pathlib import Path

import pytest
import rlinf_ranks as rr
import torch
from dist_run import run_ranks

from cloudckpt import open_checkpoint, open_store
from cloudckpt.cli import main as cloudckpt_cli
from cloudckpt.dcp import CloudStorageReader
from cloudckpt.errors import ConfigError, IncompleteCheckpointError
from cloudckpt.integrations import rlinf

PEERS_RLINF = Path(__file__).resolve().parents[3] / "shared" / "peers" / "rlinf"
CONVERTER = PEERS_RLINF / "src/rlinf/utils/ckpt_convertor/fsdp_convertor/convert_dcp_to_pt.py"
RLINF_KEYS = {f"fsdp_checkpoint.{k}" for k in
              ("model", "optimizers", "lr_schedulers", "fsdp_version", "rng")}


def _all_true(results: dict, *keys: str) -> None:
    for rank, res in results.items():
        assert not (isinstance(res, tuple) and res[0] == "error"), res[1]
        for k in keys:
            assert res[k] is True, f"rank {rank}: {k} differs after the resume"


def _rlinf_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and "cloudckpt" not in p.name}


@pytest.mark.parametrize("incremental", [False, True])
def test_cloudckpt_step_loads_with_rlinf_checkpoint_and_converter(s3, tmp_path, monkeypatch,
                                                                  incremental):
    """Also saved incrementally ($CLOUDCKPT_INCREMENTAL, every object a blob): the
    download holds RLinf's own layout, and RLinf's loader and converter read it."""
    monkeypatch.setenv("CLOUDCKPT_INCREMENTAL", "1" if incremental else "0")
    local, full = tmp_path / "downloaded", tmp_path / "full3.pt"
    results = run_ranks("rlinf_ranks.cloudckpt_to_rlinf", 2, s3.uri("logs"), s3.options_json(),
                        str(local), str(full))
    _all_true(results, "rng", "model", "optim", "sched", "draws")
    step = open_checkpoint(f"{rlinf.checkpoints_root(s3.uri('logs'), 'compat')}/global_step_3",
                           s3.options)
    assert (step.manifest.blob_depth == 1) is incremental
    in_prefix = {p for p in step.files if p not in step.manifest.blobs}
    assert (in_prefix == {"actor/dcp_checkpoint/cloudckpt-manifest.json"}) is incremental

    # The keys and value types RLinf's Checkpoint.state_dict() has (checkpoint.py:93-101).
    md = CloudStorageReader(str(local / "actor" / "dcp_checkpoint")).read_metadata()
    assert {".".join(k.split(".")[:2]) for k in md.state_dict_metadata} == RLINF_KEYS
    assert {k for k in md.state_dict_metadata if k.startswith("fsdp_checkpoint.rng.")} == {
        "fsdp_checkpoint.rng.cpu", "fsdp_checkpoint.rng.numpy", "fsdp_checkpoint.rng.random"}
    assert "fsdp_checkpoint.lr_schedulers.0.step_size" in md.state_dict_metadata
    full3 = torch.load(full, weights_only=True)
    assert torch.equal(torch.load(local / "actor/model_state_dict/full_weights.pt",
                                  weights_only=True)["0.weight"], full3["0.weight"])
    assert torch.load(local / "data/data.pt", weights_only=True) == {"epoch": 0, "pos": 3}
    assert set(results[0]["files"]) >= {"actor/model_state_dict/full_weights.pt",
                                        "data/data.pt", "actor/dcp_checkpoint/.metadata"}

    # RLinf's converter, run as its docstring says, on the downloaded step.
    out = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, str(CONVERTER), "--dcp_path",
                           str(local / "actor" / "dcp_checkpoint"), "--output_path", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    converted = torch.load(out, weights_only=True)
    assert converted.keys() == full3.keys()
    assert all(torch.equal(converted[k], full3[k]) for k in full3)


def test_rlinf_step_uploaded_with_one_command_resumes_in_cloudckpt(s3, tmp_path):
    step = tmp_path / "logs" / "compat" / "checkpoints" / "global_step_3"
    results = run_ranks("rlinf_ranks.rlinf_to_cloudckpt", 2, str(step), s3.uri("logs"),
                        s3.options_json())
    _all_true(results, "rng", "model", "optim", "sched", "draws")
    root = rlinf.checkpoints_root(s3.uri("logs"), "compat")
    assert {r["uri"] for r in results.values()} == {f"{root}/global_step_3"}
    assert all(r["step"] == 3 and r["data"] == {"epoch": 0, "pos": 3} for r in results.values())

    # Every file RLinf wrote is in the committed step, checksummed.
    ckpt = open_checkpoint(f"{root}/global_step_3", s3.options)
    assert ckpt.manifest.kind == "rlinf" and ckpt.step == 3
    rlinf_files = _rlinf_files(step)
    assert rlinf_files == {"actor/dcp_checkpoint/.metadata", "actor/dcp_checkpoint/__0_0.distcp",
                           "actor/dcp_checkpoint/__1_0.distcp",
                           "actor/model_state_dict/full_weights.pt", "data/data.pt"}
    assert rlinf_files <= set(ckpt.files)
    ckpt.verify(deep=True)


def _single(seed: int) -> tuple:
    return rr.build(1, seed)


def test_stock_step_in_gcs_adopted_with_one_command_then_resumes(gcs, tmp_path, caplog):
    model, optim, sched = _single(0)
    rr.train(model, optim, sched, rr.STEPS_BEFORE)
    step = tmp_path / "global_step_3"
    rr.rlinf_save(model, optim, sched, str(step), {"epoch": 0, "pos": 3})
    saved = rr.outcome(model, optim, sched)["draws"]
    rr.train(model, optim, sched, rr.STEPS_AFTER)
    expected = rr.outcome(model, optim, sched)

    # Uploaded as-is, as `gsutil cp -r` would: no manifest, so not yet resumable.
    root = rlinf.checkpoints_root(gcs.uri("logs"), "exp")
    bucket_step = open_store(f"{root}/global_step_3", gcs.options)
    for path in _rlinf_files(step):
        bucket_step.put(path, (step / path).read_bytes())
    with pytest.raises(IncompleteCheckpointError, match="rlinf adopt"):
        rlinf.resolve_resume_dir("auto", root, gcs.options)
    with pytest.raises(IncompleteCheckpointError, match="written by RLinf itself"):
        rlinf.resolve_resume_dir(bucket_step.uri, root, gcs.options)

    endpoint = gcs.options["endpoint_url"]
    assert cloudckpt_cli(["rlinf", "adopt", bucket_step.uri, "-o", f"endpoint_url={endpoint}",
                          "-o", "token=anon"]) == 0
    model2, optim2, sched2 = _single(99)
    ck = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(gcs.uri("logs"), "exp", resume_dir="auto"),
                                 storage_options=gcs.options)
    state = rlinf.fsdp_state_dict(model2, optim2, sched2)
    resumed = ck.load(ck.resume_uri(), state)
    rlinf.load_fsdp_state_dict(model2, optim2, sched2, state)
    assert resumed.step == 3 and resumed.data_state == {"epoch": 0, "pos": 3}
    assert rr.same(rr.outcome(model2, optim2, sched2)["draws"], saved)
    rr.train(model2, optim2, sched2, rr.STEPS_AFTER)
    got = rr.outcome(model2, optim2, sched2)
    assert rr.same(got["model"], expected["model"]) and rr.same(got["optim"], expected["optim"])
    assert rr.same(got["sched"], expected["sched"]) and rr.same(got["draws"], expected["draws"])
    # The adopted step's objects are checksummed; a damaged one is now caught.
    bucket_step.put("data/data.pt", b"x" + bucket_step.get("data/data.pt")[1:])
    with pytest.raises(Exception, match="data.pt"):
        ck.load(ck.resume_uri(), rlinf.fsdp_state_dict(model2, optim2, sched2))


def test_local_cloudckpt_step_loads_in_place_with_rlinf(local):
    """On local disk there is nothing to download: RLinf's loader reads the step
    cloudckpt wrote where it lies (the manifests beside its files are ignored)."""
    model, optim, sched = _single(0)
    rr.train(model, optim, sched, rr.STEPS_BEFORE)
    ck = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(local.uri("logs"), "exp", save_interval=3),
                                 storage_options=local.options)
    ck.save(3, rlinf.fsdp_state_dict(model, optim, sched))
    saved = rr.outcome(model, optim, sched)
    model2, optim2, sched2 = _single(99)
    rr.rlinf_load(model2, optim2, sched2, f"{ck.step_uri(3)}/actor")
    got = rr.outcome(model2, optim2, sched2)
    assert all(rr.same(got[k], saved[k]) for k in ("model", "optim", "sched", "draws"))
    full = torch.load(io.BytesIO(open_store(ck.step_uri(3)).get(
        "actor/model_state_dict/full_weights.pt")), weights_only=True)
    assert rr.same(full, saved["model"])


def _check_progress():
    """RLinf's own ``check_progress`` (reference/runner_utils.py), loaded from the
    file with its one import, ``rlinf.utils.logging.get_logger``, stood in for."""
    stub = types.ModuleType("rlinf.utils.logging")
    stub.get_logger = lambda *a, **k: __import__("logging").getLogger("rlinf")
    sys.modules.setdefault("rlinf.utils.logging", stub)
    spec = importlib.util.spec_from_file_location("rlinf_runner_utils",
                                                  PEERS_RLINF / "reference/runner_utils.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.check_progress


@pytest.mark.parametrize("max_steps,max_epochs,per_epoch,interval", [
    (-1, 2, 7, 5), (-1, 3, 4, 50), (10, 3, 4, 3), (100, 2, 6, 4), (-1, 1, 9, 0), (-1, 2, 5, -1)])
def test_save_rule_and_last_step_match_rlinf(max_steps, max_epochs, per_epoch, interval):
    check_progress = _check_progress()
    # reasoning_runner._set_max_steps: len(dataloader) * max_epochs, capped by max_steps >= 0.
    last = per_epoch * max_epochs if max_steps < 0 else min(per_epoch * max_epochs, max_steps)
    cfg = {"runner": {"output_dir": "memory://rlinf-compat/rule", "experiment_name": "e",
                      "max_steps": max_steps, "max_epochs": max_epochs,
                      "save_interval": interval, "val_check_interval": -1}}
    ck = rlinf.RLinfCheckpointer.from_config(cfg, steps_per_epoch=per_epoch)
    assert ck.max_steps == last
    ours = [s for s in range(1, last + 1) if ck.should_save(s)]
    theirs = [s for s in range(1, last + 1) if check_progress(s, last, -1, interval, 1.0)[1]]
    assert ours == theirs
    if interval > 0:
        assert ours[-1] == last  # the final step is always saved


def test_max_steps_minus_one_without_dataloader_length_is_refused():
    cfg = {"runner": {"output_dir": "memory://rlinf-compat/x", "experiment_name": "e",
                      "max_steps": -1, "max_epochs": 2, "save_interval": 5}}
    with pytest.raises(ConfigError, match="steps_per_epoch"):
        rlinf.RLinfCheckpointer.from_config(cfg).should_save(5)


@pytest.mark.parametrize("value", ["Auto", "AUTO", "None", "null", "", "/logs/e/step_5",
                                   "/logs/e/global_step_x"])
def test_resume_dir_strings_rlinf_cannot_parse_are_refused(value):
    # RLinf: `== "auto"`, else int(resume_dir.split("global_step_")[-1]) -> ValueError.
    with pytest.raises(ConfigError, match="resume_dir"):
        rlinf.resolve_resume_dir(value, "memory://rlinf-compat/none")
    assert rlinf.resolve_resume_dir(None, "memory://rlinf-compat/none") is None
    assert rlinf.resolve_resume_dir("auto", "memory://rlinf-compat/none") is None
