"""RLinf integration: RLinf's runner keys and global_step_N layout on a bucket.

End to end, real processes are SIGKILLed (one mid-save, a torchrun job from
outside) and resume from s3:// (``resume_dir: auto`` and an explicit URI with a
trailing slash) to the same per-step losses and final parameters as a run that
never stopped. Torn checkpoints are built by hand to show where RLinf's own
completeness rule ("actor/ and data/data.pt exist") and the manifest disagree.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from dist_run import run_ranks
from training_runs import explain, launcher, losses, run_and_kill

from cloudckpt import IncompleteCheckpointError, list_checkpoints, open_checkpoint, open_store
from cloudckpt.cli import main as cloudckpt_cli
from cloudckpt.core.claim import CLAIM_NAME
from cloudckpt.dcp import CloudStorageReader, adopt
from cloudckpt.errors import CommitConflictError, ConfigError, CorruptCheckpointError
from cloudckpt.integrations import rlinf
from cloudckpt.names import DCP_INDEX_NAME

REPO = Path(__file__).parent.parent
EXAMPLE = REPO / "examples" / "rlinf" / "train.py"
CONFIG = REPO / "examples" / "rlinf" / "config.yaml"
MAX_STEPS, EVERY = 12, 3


# ------------------------------------------------------------------ helpers


def command(backend, output_dir: str, ranks: int, *extra: str) -> list[str]:
    return [*launcher(ranks), str(EXAMPLE), "--storage-options", backend.options_json(), *extra,
            f"runner.output_dir={output_dir}", f"runner.max_steps={MAX_STEPS}",
            f"runner.save_interval={EVERY}"]


def child_env() -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO)}


def run(backend, output_dir: str, ranks: int, *extra: str, ok: bool = True) -> str:
    proc = subprocess.run(command(backend, output_dir, ranks, *extra), capture_output=True,
                          text=True, env=child_env(), timeout=240)
    if ok:
        assert proc.returncode == 0, explain(proc)
        assert "done" in proc.stdout
    return proc.stdout + proc.stderr


def assert_same_run(reference: dict[int, str], *parts: str) -> None:
    merged: dict[int, str] = {}
    for part in parts:
        for step, loss in losses(part).items():
            assert loss == reference[step], f"step {step}: {loss} != {reference[step]}"
            merged[step] = loss
    assert merged == reference


def assert_same_params(a: Path, b: Path) -> None:
    pa, pb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert pa.keys() == pb.keys() and pa
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def assert_same_params_dict(full: dict, final: dict) -> None:
    """full_weights.pt of the last step holds the final model (RLinf's names)."""
    assert full.keys() == final.keys() and full
    assert all(torch.equal(full[k], final[k]) for k in full)


def old_rlinf_complete(store, name: str, critic: bool = False) -> bool:
    """RLinf's own rule: complete when actor/, critic/ (if the run has one) and
    data/data.pt exist. Existence only: no size, no checksum, no commit marker."""
    step = store.child(name)
    return (bool(step.list("actor/")) and (not critic or bool(step.list("critic/")))
            and step.exists("data/data.pt"))


def old_rlinf_latest(store) -> int | None:
    steps = [rlinf.parse_step(n) for n in store.list_prefixes()
             if n.startswith("global_step_") and old_rlinf_complete(store, n)]
    return max(steps, default=None)


# ------------------------------------------------------------------ units


def test_config_rules_and_names():
    cfg = yaml.safe_load(CONFIG.read_text())
    rc = rlinf.RunnerConfig.from_config(cfg)
    assert (rc.output_dir, rc.experiment_name) == ("s3://my-bucket/rlinf-logs", "tiny-grpo")
    assert (rc.save_interval, rc.resume_dir, rc.max_steps, rc.max_epochs) == (3, "auto", -1, 1)
    assert rc.total_steps(16) == 16 and rc.total_steps(None) is None
    assert rc.root == "s3://my-bucket/rlinf-logs/tiny-grpo/checkpoints"
    assert rlinf.RunnerConfig.from_config(cfg["runner"]) == rc
    assert rlinf.RunnerConfig.from_config({**cfg["runner"], "save_interval": 0}).save_interval == 0
    with pytest.raises(ConfigError, match="output_dir"):
        rlinf.RunnerConfig.from_config({"runner": {"experiment_name": "x"}})

    assert [s for s in range(1, 12) if rlinf.should_save(s, 3, max_steps=10)] == [3, 6, 9, 10]
    assert not any(rlinf.should_save(s, 0, max_steps=10) for s in range(1, 12))
    assert not rlinf.should_save(10, -1, max_steps=10, time_limit_hit=True)
    assert rlinf.should_save(4, 3, time_limit_hit=True)

    assert rlinf.parse_step("s3://b/x/checkpoints/global_step_150/") == 150
    assert rlinf.parse_step("/logs/e/checkpoints/global_step_7") == 7
    for bad in ("s3://b/x/global_step_", "s3://b/x/step-5", "global_step_1x"):
        with pytest.raises(ConfigError, match="global_step_"):
            rlinf.parse_step(bad)
    assert rlinf.resolve_resume_dir(None, "memory://rlinf-unit/none") is None
    for bad in ("", "null", "None", "Auto"):  # RLinf fails on these too (int(...))
        with pytest.raises(ConfigError, match="resume_dir"):
            rlinf.resolve_resume_dir(bad, "memory://rlinf-unit/none")


def test_time_limit_and_keep_last(memory):
    ck = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(memory.uri("out"), "exp", save_interval=100,
                                                    max_steps=1000),
                                 rlinf.SaveOptions(time_limit_s=0.0, keep_last=2))
    assert ck.should_save(7)  # time limit hit: save although 7 % 100 != 0
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 3, 4):
        ck.save(step, rlinf.fsdp_state_dict(model, optim), data_state={"pos": step})
    assert [c.name for c in list_checkpoints(ck.root)] == ["global_step_3", "global_step_4"]
    assert rlinf.resolve_resume_dir("auto", ck.root) == ck.step_uri(4)
    with pytest.raises(CommitConflictError, match="cloudckpt rm"):
        ck.save(4, rlinf.fsdp_state_dict(model, optim), data_state={"pos": 4})
    disabled = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(memory.uri("out"), "exp",
                                                          save_interval=0),
                                       rlinf.SaveOptions(time_limit_s=0.0))
    assert not disabled.should_save(3)


def test_a_load_the_checkpoint_refuses_applies_nothing(memory):
    """A critic asked of a step that has none, or a step copied under a newer name:
    refused before a tensor of the actor (or the RNG) is loaded, by the checkpointer and
    by ``resume_dir: auto``, which RLinf's workers load from."""
    from cloudckpt.movement.checkpoint_copy import copy_checkpoint

    ck = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(memory.uri("out"), "exp", save_interval=1,
                                                    max_steps=10))
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    ck.save(1, rlinf.fsdp_state_dict(model, optim), data_state={"pos": 1})
    other = torch.nn.Linear(3, 2)
    actor = rlinf.fsdp_state_dict(other, torch.optim.AdamW(other.parameters()))
    critic_optim = torch.optim.AdamW(other.parameters())
    before = {k: v.clone() for k, v in actor["fsdp_checkpoint"]["model"].items()}
    rng = torch.get_rng_state()

    def untouched() -> bool:
        now = actor["fsdp_checkpoint"]["model"]
        return all(torch.equal(now[k], v) for k, v in before.items()) and torch.equal(
            torch.get_rng_state(), rng)

    with pytest.raises(ConfigError, match="has no critic/ part"):
        ck.load(ck.step_uri(1), actor, critic=rlinf.fsdp_state_dict(other, critic_optim))
    assert untouched()
    copy_checkpoint(ck.step_uri(1), ck.step_uri(5))
    for load in (lambda: rlinf.resolve_resume_dir("auto", ck.root),
                 lambda: ck.load(ck.step_uri(5), actor)):
        with pytest.raises(CorruptCheckpointError, match="named for step 5 but its manifest"):
            load()
        assert untouched()


# ------------------------------------------------------------------ end to end


def test_single_process_crash_mid_save_resumes_auto_bit_exact(s3, tmp_path, caplog):
    ref = run(s3, s3.uri("ref"), 1, "--out", str(tmp_path / "ref.pt"))
    reference = losses(ref)
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))

    # SIGKILL after step 9's actor DCP part and data/data.pt are written, before the
    # root manifest: RLinf's old rule calls that step complete.
    out = s3.uri("crash")
    crash = run(s3, out, 1, "--crash-mid-save", "9", ok=False)
    assert "crashing mid-save of step 9" in crash and "done" not in crash
    root = open_store(rlinf.checkpoints_root(out, "tiny-grpo"), s3.options)
    assert old_rlinf_complete(root, "global_step_9")
    assert old_rlinf_latest(root) == 9
    with caplog.at_level(logging.WARNING, logger="cloudckpt.integrations.rlinf"):
        assert rlinf.resolve_resume_dir("auto", root) == root.child("global_step_6").uri
    assert any("global_step_9" in r.getMessage() and "torn" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)

    resumed = run(s3, out, 1, "runner.resume_dir=auto", "--out", str(tmp_path / "a.pt"))
    assert f"resumed at step 6 from {root.child('global_step_6').uri}" in resumed
    assert "torn checkpoint" in resumed  # the WARNING, in the resumed job's log
    assert_same_run(reference, crash, resumed)
    assert_same_params(tmp_path / "ref.pt", tmp_path / "a.pt")
    # The retried save of step 9 replaced the leftovers and committed.
    assert [c.name for c in list_checkpoints(root)] == [
        f"global_step_{s}" for s in (3, 6, 9, 12)]


def test_two_ranks_sigkill_resume_explicit_uri_bit_exact_and_layout(s3, tmp_path):
    ref_dir = s3.uri("ref2")
    ref = run(s3, ref_dir, 2, "--out", str(tmp_path / "ref.pt"))
    reference = losses(ref)
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))

    # Layout, as RLinf's FSDP backend writes it, plus the manifests and the indexed
    # format's index and records (a small job's .metadata is written too).
    root = open_store(rlinf.checkpoints_root(ref_dir, "tiny-grpo"), s3.options)
    assert [c.name for c in list_checkpoints(root)] == [
        f"global_step_{s}" for s in (3, 6, 9, 12)]
    step = root.child("global_step_12")
    names = {o.key for o in step.list()}
    assert names == {"actor/dcp_checkpoint/.metadata", "actor/dcp_checkpoint/__0_0.distcp",
                     "actor/dcp_checkpoint/__1_0.distcp",
                     "actor/dcp_checkpoint/__0_records", "actor/dcp_checkpoint/__1_records",
                     f"actor/dcp_checkpoint/{DCP_INDEX_NAME}",
                     "actor/dcp_checkpoint/cloudckpt-manifest.json",
                     "actor/model_state_dict/full_weights.pt", "data/data.pt",
                     "cloudckpt-manifest.json"}
    ckpt = open_checkpoint(step)
    assert ckpt.step == 12 and ckpt.manifest.kind == "rlinf"
    assert set(ckpt.files) == names - {"cloudckpt-manifest.json"}
    ckpt.verify(deep=True)
    data = torch.load(io.BytesIO(ckpt.read("data/data.pt")), weights_only=True)
    assert data == {"epoch": 0, "pos": 12}  # 12 of 16 batches of 8 (128 samples per rank)
    md = CloudStorageReader(step.child("actor/dcp_checkpoint")).read_metadata()
    tops = {".".join(k.split(".")[:2]) for k in md.state_dict_metadata}
    assert tops == {f"fsdp_checkpoint.{k}" for k in
                    ("model", "optimizers", "lr_schedulers", "fsdp_version", "rng")}
    assert {k for k in md.state_dict_metadata if k.startswith("fsdp_checkpoint.rng.")} == {
        "fsdp_checkpoint.rng.cpu", "fsdp_checkpoint.rng.numpy", "fsdp_checkpoint.rng.random"}
    full = torch.load(io.BytesIO(ckpt.read("actor/model_state_dict/full_weights.pt")),
                      weights_only=True)
    assert_same_params_dict(full, torch.load(tmp_path / "ref.pt", weights_only=True))

    # SIGKILL the whole torchrun job from outside at a random step.
    out = s3.uri("kill2")
    kill_at = random.Random(2).randrange(4, MAX_STEPS - 1)
    first = run_and_kill(command(s3, out, 2), child_env(), kill_at)
    kroot = open_store(rlinf.checkpoints_root(out, "tiny-grpo"), s3.options)
    committed = list_checkpoints(kroot)
    assert committed, "no checkpoint committed before the kill"
    latest = committed[-1]
    resume_step = rlinf.parse_step(latest.name)
    assert resume_step % EVERY == 0 and resume_step <= max(losses(first))
    explicit = latest.uri + "/"
    resumed = run(s3, out, 2, f"runner.resume_dir={explicit}", "--out", str(tmp_path / "b.pt"))
    assert f"resumed at step {resume_step} from {latest.uri}" in resumed
    assert min(losses(resumed)) == resume_step + 1
    assert_same_run(reference, first, resumed)
    assert_same_params(tmp_path / "ref.pt", tmp_path / "b.pt")


# ------------------------------------------------------------------ torn checkpoints


def _copy(store, src: str, dst: str, *, skip=(), mutate=None) -> None:
    """A torn step as a crashed save leaves it: some objects, and the claim its
    coordinator took before any rank wrote (see cloudckpt.training.multipart.claim)."""
    store.child(dst).put(CLAIM_NAME, json.dumps({"writer": "crashed", "host": "node-7",
                                                 "pid": 1, "since": 0}).encode())
    for obj in store.child(src).list():
        if obj.key in skip:
            continue
        data = store.child(src).get(obj.key)
        if mutate and obj.key in mutate:
            data = mutate[obj.key](data)
        store.child(dst).put(obj.key, data)


def test_torn_checkpoints_old_rule_vs_manifest(s3, caplog):
    ck = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(s3.uri("logs"), "torn", save_interval=2),
                                 storage_options=s3.options)
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    for step in (2, 4):
        model(torch.randn(2, 64)).sum().backward()
        optim.step()
        ck.save(step, rlinf.fsdp_state_dict(model, optim), data_state={"pos": step})
    store = ck.store
    half = lambda b: b[: len(b) // 2]  # noqa: E731
    shard = "actor/dcp_checkpoint/__0_0.distcp"
    root_manifest = "cloudckpt-manifest.json"
    # 6: actor written, data/data.pt missing (killed before writing it).
    _copy(store, "global_step_4", "global_step_6", skip={"data/data.pt", root_manifest})
    # 8: everything there, but data.pt half-written.
    _copy(store, "global_step_4", "global_step_8", skip={root_manifest},
          mutate={"data/data.pt": half})
    # 10: killed while an actor shard was being written (so no DCP manifest either),
    # data.pt from an earlier attempt present.
    _copy(store, "global_step_4", "global_step_10",
          skip={root_manifest, "actor/dcp_checkpoint/cloudckpt-manifest.json"},
          mutate={shard: half})
    # 12: everything there and intact, only the root manifest missing.
    _copy(store, "global_step_4", "global_step_12", skip={root_manifest})

    old = {n: old_rlinf_complete(store, f"global_step_{n}") for n in (2, 4, 6, 8, 10, 12)}
    assert old == {2: True, 4: True, 6: False, 8: True, 10: True, 12: True}
    assert old_rlinf_latest(store) == 12
    with caplog.at_level(logging.WARNING, logger="cloudckpt.integrations.rlinf"):
        assert rlinf.resolve_resume_dir("auto", store) == ck.step_uri(4)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert all(f"global_step_{n}" in warned for n in (6, 8, 10, 12))

    # Where it matters: what the old rule would resume from is broken.
    with pytest.raises(Exception):  # noqa: B017 - any unpickling error
        torch.load(io.BytesIO(store.child("global_step_8").get("data/data.pt")),
                   weights_only=True)
    # Every DCP file still "exists"; only a size/checksum check sees the short shard.
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp"):
        adopt(store.child("global_step_10/actor/dcp_checkpoint"))
    # Explicit resume_dir to a torn step is refused with a clear message.
    for n in (8, 12):
        with pytest.raises(IncompleteCheckpointError, match="no manifest"):
            rlinf.resolve_resume_dir(ck.step_uri(n) + "/", store)

    # Ours loads step 4 exactly; the step is cross-checked with the manifest.
    fresh = torch.nn.Linear(64, 64)
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    state = rlinf.fsdp_state_dict(fresh, fresh_optim)
    res = ck.load(rlinf.resolve_resume_dir("auto", store), state)
    rlinf.load_fsdp_state_dict(fresh, fresh_optim, None, state)
    assert res.step == 4 and res.data_state == {"pos": 4}
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    _copy(store, "global_step_4", "global_step_7")  # renamed: name says 7, manifest says 4
    with pytest.raises(CorruptCheckpointError, match="step 7 but its manifest says step 4"):
        rlinf.resolve_resume_dir(ck.step_uri(7), store)


# ------------------------------------------------------------------ converter


def test_converter_on_two_rank_checkpoint(s3, tmp_path, caplog):
    out_dir = s3.uri("conv-logs")
    files = run_ranks("rlinf_workers.save_fsdp_actor", 2, out_dir, s3.options_json(),
                      str(tmp_path / "full.pt"))[0]
    assert {"actor/dcp_checkpoint/__0_0.distcp", "actor/dcp_checkpoint/__1_0.distcp",
            "data/data.pt"} <= set(files)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    step_uri = f"{rlinf.checkpoints_root(out_dir, 'conv')}/global_step_3"

    # As a command, like RLinf's convert script: --dcp_path (whole step, trailing slash).
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("cloudckpt")), "rlinf", "convert", "--dcp_path",
         step_uri + "/", "--output_path", str(tmp_path / "model.pt"),
         "--storage-options", s3.options_json()],
        capture_output=True, text=True, env=child_env(), timeout=120)
    assert proc.returncode == 0, explain(proc)
    converted = torch.load(tmp_path / "model.pt", weights_only=True)
    assert converted.keys() == full.keys()
    assert all(torch.equal(converted[k], full[k]) for k in full)

    # cloudckpt.cli.main(argv) in process: the DCP prefix itself, output to the bucket.
    dst = s3.uri("exports", "model.pt")
    argv = ["convert", "--dcp_path", f"{step_uri}/actor/dcp_checkpoint", "--output_path", dst,
            "--storage-options", s3.options_json()]
    assert cloudckpt_cli(["rlinf", *argv]) == 0
    remote = torch.load(io.BytesIO(open_store(s3.uri("exports"), s3.options).get("model.pt")),
                        weights_only=True)
    assert all(torch.equal(remote[k], full[k]) for k in full)
    assert cloudckpt_cli(["rlinf", "convert", "--dcp_path", s3.uri("nothing"), "--output_path",
                          dst, "--storage-options", s3.options_json()]) == 3  # not found

    # Resharding: the 2-rank checkpoint loads into one process (per-rank RNG dropped).
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2)
    ck = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(out_dir, "conv"), storage_options=s3.options)
    state = rlinf.fsdp_state_dict(model, optim, sched)  # as saved: one scheduler
    res = ck.load(step_uri + "/", state)  # one RNG copy, restored on any world size
    rlinf.load_fsdp_state_dict(model, optim, sched, state)
    assert sched.last_epoch == 3
    assert res.step == 3 and res.data_state == {"epoch": 0, "pos": 3}
    assert all(torch.equal(model.state_dict()[k], full[k]) for k in full)
    assert json.loads(json.dumps(res.checkpoint.metadata["parts"])) == ["actor"]


def test_migration_guide_example_runs():
    import re

    text = (REPO / "docs" / "integrations" / "rlinf.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "memory://" in b]
    assert blocks, "docs/integrations/rlinf.md lost its runnable example"
    for block in blocks:
        exec(compile(block, "docs/integrations/rlinf.md", "exec"), {})
    # The by-hand example's config is as the guide says: a bucket output_dir, a local
    # log path (a trainer of one's own has no RLinf output_redirector to place it).
    assert "with a bucket `output_dir` and a local `logger.log_path`" in text
    runner = yaml.safe_load(CONFIG.read_text())["runner"]
    assert runner["output_dir"].startswith("s3://") and "://" not in runner["logger"]["log_path"]
