"""AReaL integration: AReaL's config keys, layout and recover-info schemas on a bucket;
a SIGKILLed run resumes bit-exactly; a crash mid-dump never yields weights and recover
info that disagree (which AReaL's in-place overwrite does)."""

from __future__ import annotations

import getpass
import importlib.util
import json
import logging
import pickle
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import areal_legacy
import pytest
import torch
from test_resume import assert_same_params, assert_same_run
from training_runs import losses, run_and_kill

from cloudckpt import StepInfo, open_store
from cloudckpt.core.liveness import _whoami
from cloudckpt.errors import CommitConflictError, ConfigError
from cloudckpt.hf import load_state_dict as load_export
from cloudckpt.integrations import areal
from cloudckpt.integrations.areal.plugin import KIND
from cloudckpt.names import SLOT_POINTER_NAME

INFO_FILES = ("saver_info.json", "evaluator_info.json", "stats_logger_info.json",
              "checkpoint_info.json", "dataloader_info.pkl", "step_info.json")

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "examples" / "areal" / "train.py"
CONFIG = ROOT / "examples" / "areal" / "config.yaml"
STEPS = 14  # 6 steps per epoch; recover dumps at 2, 5, 8, 11; HF exports at 5, 11
FREQ_CTL_KEYS = {"frequence_seconds", "frequency_steps", "start_time", "steps", "last_time",
                 "last_steps", "interval_steps", "interval_seconds", "initial_value"}


def _example():
    spec = importlib.util.spec_from_file_location("areal_example_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def configs(backend, trial: str = "t0") -> tuple[areal.SaverConfig, areal.RecoverConfig]:
    saver, recover = areal.load_yaml(CONFIG)
    fields = {"fileroot": backend.uri("experiments"), "trial_name": trial, "user": "alice"}
    return replace(saver, **fields), replace(recover, **fields)


# ------------------------------------------------------------------------- config


def test_config_keys_and_validation():
    saver, recover = areal.load_yaml(CONFIG)
    assert recover.mode == "on" and recover.enabled  # YAML `on` is a string, as in OmegaConf
    assert saver.fileroot == recover.fileroot == "s3://areal-ckpt/experiments"
    assert (saver.experiment_name, saver.trial_name) == ("areal-cloudckpt-demo", "trial0")
    assert (saver.freq_epochs, recover.freq_steps, recover.freq_secs) == (1, 3, 3600)

    base = {"experiment_name": "e", "trial_name": "t", "fileroot": "gs://b/x"}
    assert areal.RecoverConfig.from_dict(base).mode == "disabled"
    assert not areal.RecoverConfig.from_dict({**base, "mode": "off"}).enabled
    assert areal.SaverConfig.from_dict({**base, "mode": "async"}).mode == "async"
    for bad in ({**base, "freq_step": 3}, {**base, "freq_steps": 0}, {**base, "freq_secs": "1h"},
                {**base, "freq_epochs": True}, {**base, "mode": "sometimes"},
                {"trial_name": "t"}, {**base, "experiment_name": "a/b"}, {**base, "fileroot": ""}):
        with pytest.raises(ConfigError):
            areal.SaverConfig.from_dict(bad)
    for bad in ({**base, "retries": -1}, {**base, "mode": "fault"}, {**base, "mode": True}):
        with pytest.raises(ConfigError):
            areal.RecoverConfig.from_dict(bad)
    with pytest.raises(ConfigError):
        areal.SaverConfig.from_dict(["not", "a", "mapping"])
    cfg = areal.SaverConfig.from_dict({**base, "user": "bob"})
    assert areal.save_root(cfg) == "gs://b/x/checkpoints/bob/e/t"


def test_reading_an_areal_config_without_pyyaml_names_the_extra(monkeypatch):
    """PyYAML is the ``areal`` extra's: an install without it is told what to install
    when AReaL's YAML is read (by the integration and by the doctor), not before."""
    from cloudckpt.integrations.areal import doctor

    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    extra = r"needs pyyaml .*: pip install 'cloudckpt\[areal\]'"
    with pytest.raises(ConfigError, match=r"reading an AReaL config " + extra):
        areal.load_yaml(CONFIG)
    with pytest.raises(ConfigError, match=r"whether .*config.yaml is an AReaL config " + extra):
        doctor.recognise([str(CONFIG)])


def test_freq_ctl_matches_areal_semantics_and_schema():
    ctl = areal.FreqCtl(freq_epochs=1, freq_steps=4, freq_secs=None)
    fired = [ctl.check(epochs=int(s % 6 == 5), steps=1) for s in range(12)]
    # steps 3, 7, 11 (every 4th call) and the epoch ends 5, 11
    assert [i for i, f in enumerate(fired) if f] == [3, 5, 7, 11]
    state = json.loads(json.dumps(ctl.state_dict()))
    assert set(state) == {"epoch", "step", "time"}
    assert all(set(v) == FREQ_CTL_KEYS for v in state.values())
    again = areal.FreqCtl(freq_epochs=1, freq_steps=4, freq_secs=None)
    again.load_state_dict(state)
    ctl_next = [ctl.check(epochs=int(s % 6 == 5), steps=1) for s in range(12, 20)]
    assert [again.check(epochs=int(s % 6 == 5), steps=1) for s in range(12, 20)] == ctl_next


def test_run_with_retries_function(caplog):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError(f"boom {len(calls)}")
        return "finished"

    assert areal.run_with_retries(flaky, retries=2, delay_s=0) == "finished"
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="boom 2"):
        areal.run_with_retries(flaky, retries=1, delay_s=0)
    with pytest.raises(ConfigError):
        areal.run_with_retries(flaky, retries=-1)


# -------------------------------------------------------------- layout and schemas


def test_layout_and_recover_info_match_areal(s3, capsys):
    example = _example()
    args = example.parse_args(["--fileroot", s3.uri("experiments"), "--trial-name", "t0",
                               "--storage-options", s3.options_json(), "--steps", str(STEPS)])
    assert example.train(args) == 0
    assert "dumped step 11" in capsys.readouterr().out
    saver_cfg, recover_cfg = areal.load_yaml(CONFIG)
    saver_cfg = replace(saver_cfg, fileroot=s3.uri("experiments"), trial_name="t0")
    root = areal.save_root(saver_cfg)
    assert root.endswith(f"/checkpoints/{getpass.getuser()}/"
                         "areal-cloudckpt-demo/t0")
    store = open_store(root, s3.options)
    keys = {o.key for o in store.list()}
    gens = {k.split("/")[0] for k in keys if k.startswith("gen-")}
    assert len(gens) == 1 and "slot-pointer.json" in keys
    gen = gens.pop()
    # AReaL's layout inside the one generation: the engine's DCP and recover_info/
    assert {k.removeprefix(gen + "/") for k in keys if k.startswith(gen)} == {
        "default/recover_checkpoint/.metadata", "default/recover_checkpoint/__0_0.distcp",
        *(f"recover_info/{f}" for f in INFO_FILES), "recover_info/cloudckpt_rng_rank00000.bin",
        "cloudckpt-manifest.json"}
    assert {k for k in keys if not k.startswith(gen)} == {"slot-pointer.json", *(
        f"default/{e}/{f}" for e in ("epoch0epochstep5globalstep5",
                                     "epoch1epochstep5globalstep11")
        for f in ("config.json", "model.safetensors", "cloudckpt-manifest.json"))}

    info = {f: json.loads(store.get(f"{gen}/recover_info/{f}")) for f in INFO_FILES
            if f.endswith(".json")}
    assert info["step_info.json"] == {"epoch": 1, "epoch_step": 5, "global_step": 11,
                                      "steps_per_epoch": 6}
    assert info["stats_logger_info.json"] == {"last_commit_step": 10}
    for name in ("saver_info.json", "evaluator_info.json", "checkpoint_info.json"):
        assert set(info[name]) == {"epoch", "step", "time"}, name
        assert all(set(v) == FREQ_CTL_KEYS for v in info[name].values()), name
    assert info["checkpoint_info.json"]["step"]["frequency_steps"] == 3
    assert info["checkpoint_info.json"]["step"]["steps"] == 12
    assert info["saver_info.json"]["epoch"]["steps"] == 2  # two epoch ends seen

    # AReaL's own format: a plain pickle of the (single process) dataloader state
    raw = store.get(f"{gen}/recover_info/dataloader_info.pkl")
    assert pickle.loads(raw) == {"epoch": 1, "pos": 6}
    recover_cfg = replace(recover_cfg, fileroot=s3.uri("experiments"), trial_name="t0")
    assert areal.read_dataloader_info(recover_cfg, storage_options=s3.options) == {
        "epoch": 1, "pos": 6}
    # the DCP keys are AReaL's FSDP engine's
    md = pickle.loads(store.get(f"{gen}/default/recover_checkpoint/.metadata"))
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in md.state_dict_metadata} >= {
        "dcp.model", "dcp.optim"}

    # HF exports load; the newest committed one is found, a torn newer one is ignored
    export = load_export(f"{root}/default/epoch1epochstep5globalstep11", s3.options)
    assert set(export) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    store.put("default/epoch2epochstep0globalstep12/model.safetensors", b"torn")
    latest = areal.latest_export(saver_cfg, storage_options=s3.options)
    assert latest.uri.rstrip("/").endswith("epoch1epochstep5globalstep11")
    assert [c.uri.rstrip("/").rsplit("/", 1)[1] for c in areal.list_exports(
        saver_cfg, storage_options=s3.options)] == ["epoch0epochstep5globalstep5",
                                                    "epoch1epochstep5globalstep11"]


# --------------------------------------------------- crash, relaunch, bit-exact resume


def _cmd(s3, trial: str, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--fileroot", s3.uri("experiments"), "--trial-name",
            trial, "--storage-options", s3.options_json(), "--steps", str(STEPS), *extra]


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def test_sigkill_relaunch_resume_is_bit_exact(s3, tmp_path):
    ref = subprocess.run(_cmd(s3, "reference", "--out", str(tmp_path / "ref.pt")),
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = losses(ref.stdout)
    assert sorted(reference) == list(range(STEPS))

    # 1. SIGKILL from outside at step 7, between dumps (last dump: step 5)
    first = run_and_kill(_cmd(s3, "crashy"), _env(), 7)
    assert "dumped step 5" in first and "dumped step 8" not in first

    # 2. the launcher: the relaunch crashes once more (at step 10), the next one finishes
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        done = areal.run_with_retries(
            _cmd(s3, "crashy", "--crash-at-step", "10", "--crash-once-marker",
                 str(tmp_path / "crashed"), "--out", str(tmp_path / "resumed.pt")),
            retries=2, delay_s=0.1, env={"PYTHONWARNINGS": "ignore"}, stdout=out,
            stderr=subprocess.DEVNULL)
    assert done.returncode == 0
    text = log.read_text()
    assert text.count("resumed at step") == 2, text
    assert "resumed at step 6" in text and "resumed at step 9" in text
    assert "crashing at step 10" in text and text.rstrip().endswith("done")
    runs = text.split("resumed at step")
    assert_same_run(reference, first, *runs)
    assert_same_params(tmp_path / "ref.pt", tmp_path / "resumed.pt")


# ----------------------------------------- torn recover checkpoint: AReaL vs cloudckpt


def _tiny(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optim


def _train(model, optim, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.ones(2, 4)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_torn_dump_areal_trusts_stale_info_cloudckpt_does_not(s3, tmp_path, monkeypatch,
                                                              caplog):
    spe = 6
    # --- AReaL today (local disk): dump at step 2, then a dump at step 5 dies after
    # overwriting the weights and before writing recover_info.
    model, optim = _tiny()
    _train(model, optim, 3)
    w2 = _params(model)
    areal_legacy.dump(tmp_path, model, optim, StepInfo(0, 2, 2, spe).to_dict())
    _train(model, optim, 3)
    w5 = _params(model)
    areal_legacy.save_weights(tmp_path, model, optim)  # ... and the process dies here
    fresh, fresh_optim = _tiny(seed=1)
    step = areal_legacy.load(tmp_path, fresh, fresh_optim)
    assert step["global_step"] == 2  # resumes at step 3 ...
    assert _same(_params(fresh), w5) and not _same(_params(fresh), w2)  # ... with step 5's

    # --- cloudckpt: the same sequence; the crash hits after the new generation is
    # written, before the slot pointer moves (and, second, in the middle of the write).
    _, recover_cfg = configs(s3)
    recover_cfg = replace(recover_cfg, freq_steps=1)
    model, optim = _tiny()
    handler = areal.RecoverHandler(recover_cfg, spe, storage_options=s3.options)
    _train(model, optim, 3)
    nothing = (None, None, None, None)
    handler.dump(areal.Engine(model, optim), StepInfo(0, 2, 2, spe), *nothing)
    w2, opt2 = _params(model), optim.state_dict()["state"][0]["exp_avg"].clone()
    _train(model, optim, 3)

    class Crash(BaseException):
        pass

    def die(*args, **kwargs):
        raise Crash

    from cloudckpt.training import multipart, slot

    for target, name in ((slot.RecoverSlot, "_swap"), (multipart, "commit")):
        with monkeypatch.context() as m:
            m.setattr(target, name, die)
            with pytest.raises(Crash):
                handler.dump(areal.Engine(model, optim), StepInfo(0, 5, 5, spe), *nothing)
        fresh, fresh_optim = _tiny(seed=1)
        loader = areal.RecoverHandler(recover_cfg, spe, storage_options=s3.options)
        got = loader.load(areal.Engine(fresh, fresh_optim), *nothing)
        assert got.last_step_info.global_step == 2
        assert got.last_step_info.next().global_step == 3
        assert _same(_params(fresh), w2)
        assert torch.equal(fresh_optim.state_dict()["state"][0]["exp_avg"], opt2)

    # the next dump succeeds over the leftovers and becomes what load returns
    handler.dump(areal.Engine(model, optim), StepInfo(0, 5, 5, spe), *nothing)
    assert handler.slot.info()["step"] == 5  # the crashed dumps' leftovers are gc's
    fresh, fresh_optim = _tiny(seed=1)
    got = areal.RecoverHandler(recover_cfg, spe, storage_options=s3.options).load(
        areal.Engine(fresh, fresh_optim), *nothing)
    assert got.last_step_info.global_step == 5 and _same(_params(fresh), _params(model))
    # recover disabled over this trial, which holds a dump: refused before training
    off = replace(recover_cfg, mode="disabled")
    with pytest.raises(ConfigError, match="holds a committed recover dump of this trial, "
                       "and recover.mode is 'disabled'.*Set recover.mode: on"):
        areal.RecoverHandler(off, spe, storage_options=s3.options)
    # recover disabled over a new trial: no dump, no load
    disabled = areal.RecoverHandler(replace(off, trial_name="never-dumped"), spe,
                                    storage_options=s3.options)
    disabled.dump(areal.Engine(model, optim), StepInfo(0, 6, 6, spe), *nothing)
    assert not disabled.slot.store.exists(SLOT_POINTER_NAME)
    assert handler.slot.info()["step"] == 5
    assert disabled.load(areal.Engine(*_tiny()), *nothing) is None
    # an empty trial: a fresh start, with a warning
    caplog.set_level(logging.WARNING, logger="cloudckpt")
    empty = replace(recover_cfg, trial_name="never-saved")
    assert areal.RecoverHandler(empty, spe, storage_options=s3.options).load(
        areal.Engine(*_tiny()), *nothing) is None
    assert "starting from scratch" in caplog.text


class _Kept:
    """A stateful component (AReaL's stats logger): what a load gives it is visible."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


@pytest.mark.parametrize("bad", ["rng", "kind"])
def test_a_dump_the_load_refuses_leaves_everything_as_it_was(s3, tmp_path, bad):
    """The current generation holds an RNG state that cannot be decoded (committed so:
    its CRC32C holds), or is not an AReaL dump at all: the load refuses before it gives
    the engine, the stats logger or the RNG anything."""
    from cloudckpt.errors import CorruptCheckpointError
    from cloudckpt.movement.checkpoint_copy import download
    from cloudckpt.training.staging import upload_dir

    spe = 6
    _, recover_cfg = configs(s3, f"refused-{bad}")
    handler = areal.RecoverHandler(replace(recover_cfg, freq_steps=1), spe,
                                   storage_options=s3.options)
    model, optim = _tiny()
    _train(model, optim, 3)
    handler.dump(areal.Engine(model, optim), StepInfo(0, 2, 2, spe), None, None, _Kept(5),
                 None)
    local = tmp_path / "gen"
    download(handler.slot.current(), local)
    (local / "cloudckpt-manifest.json").unlink()
    if bad == "rng":
        (local / "recover_info" / "cloudckpt_rng_rank00000.bin").write_bytes(b"?not a state")
    kind = "generic" if bad == "kind" else KIND
    handler.slot.commit(lambda gen: upload_dir(local, gen, kind=kind, step=2), step=2)

    fresh, fresh_optim = _tiny(seed=1)
    before, stats, rng = _params(fresh), _Kept(-1), torch.get_rng_state()
    with pytest.raises(CorruptCheckpointError,
                       match="unknown encoding" if bad == "rng" else "not an AReaL"):
        handler.load(areal.Engine(fresh, fresh_optim), None, None, stats, None)
    assert _same(_params(fresh), before) and not fresh_optim.state_dict()["state"]
    assert stats.n == -1 and torch.equal(torch.get_rng_state(), rng)


def test_saver_reexport_after_a_restart(s3):
    """A crash after an export but before the next recover dump makes the relaunched
    job reach the same step again; one mid-export on another node leaves a claim
    nobody can check. Neither may stop training."""
    from cloudckpt import CheckpointWriter, open_checkpoint
    from cloudckpt.core.manifest import CLAIM_NAME

    saver_cfg, _ = configs(s3)
    saver_cfg = replace(saver_cfg, freq_steps=1)
    model = torch.nn.Linear(4, 2)
    config = {"model_type": "linear-test"}
    engine = areal.Engine(model, hf_config=config)
    first = areal.Saver(saver_cfg, 4, storage_options=s3.options)
    first.save(engine, 0, 0, 0)
    uri = first.last_export
    kept = open_checkpoint(uri, s3.options).manifest.commit_id
    relaunched = areal.Saver(saver_cfg, 4, storage_options=s3.options)
    relaunched.save(engine, 0, 0, 0)
    assert relaunched.last_export == uri
    assert open_checkpoint(uri, s3.options).manifest.commit_id == kept

    torn = relaunched.export_uri(0, 1, 1)
    open_store(torn, s3.options).put(CLAIM_NAME, json.dumps(  # a live save's, pid 1 here
        {"writer": "live", **_whoami(), "pid": 1, "since": time.time()}).encode())
    with pytest.raises(CommitConflictError):  # a plain writer may not take it
        CheckpointWriter(torn, storage_options=s3.options).put("x", b"x")
    relaunched.save(engine, 0, 1, 1)
    assert relaunched.last_export == torn
    open_checkpoint(torn, s3.options).verify(deep=True)


# ------------------------------------------- before training: the bucket, the trial


def test_missing_bucket_is_refused_before_training(s3, caplog):
    """A misspelt bucket fails at construction, naming it and what to do; it does not
    read as an empty trial ("starting from scratch") and die at the first save."""
    from cloudckpt.errors import BucketNotFoundError

    caplog.set_level(logging.INFO, logger="cloudckpt")
    bad = {"fileroot": "s3://no-such-bucket-areal/experiments"}
    saver_cfg, recover_cfg = configs(s3)
    for cls, cfg in ((areal.Saver, replace(saver_cfg, **bad)),
                     (areal.RecoverHandler, replace(recover_cfg, **bad))):
        with pytest.raises(BucketNotFoundError) as err:
            cls(cfg, 6, storage_options=s3.options)
        text = str(err.value)
        assert "s3://no-such-bucket-areal" in text and f"{type(cfg).__name__}.fileroot" in text
        assert "create the bucket" in text
    assert "starting from scratch" not in caplog.text
    # The example trainer stops before its first step, with that error.
    run = subprocess.run(_cmd(s3, "t0")[:2] + ["--fileroot", bad["fileroot"],
                                               "--storage-options", s3.options_json()],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert run.returncode != 0 and "step 0" not in run.stdout, run.stdout
    assert "BucketNotFoundError" in run.stderr and "no-such-bucket-areal" in run.stderr


def _cli_opts(backend) -> list[str]:
    return [a for k, v in backend.options.items() if k != "retry" for a in ("-o", f"{k}={v}")]


def _areal_trial_in_bucket(s3, tmp_path, trial: str) -> tuple[str, dict]:
    """A trial in AReaL's own layout, copied into the bucket object by object as
    `aws s3 sync` does (no manifests): an export and a recover dump of step 2.
    Returns its URI and the weights dumped."""
    from cloudckpt.cli import main as cloudckpt_cli

    saver_cfg, recover_cfg = configs(s3, trial)
    local = {"fileroot": str(tmp_path / "disk"), "freq_steps": 3, "freq_epochs": None,
             "freq_secs": None}
    saver_cfg, recover_cfg = replace(saver_cfg, **local), replace(recover_cfg, **local)
    model, optim = _tiny()
    engine = areal.Engine(model, optim, hf_config={"model_type": "linear-test"})
    saver, handler = areal.Saver(saver_cfg, 6), areal.RecoverHandler(recover_cfg, 6)
    for step in range(3):
        _train(model, optim, 1)
        saver.save(engine, 0, step, step)
        handler.dump(engine, StepInfo(0, step, step, 6), saver, None, None, None)
    on_disk = tmp_path / "areal-layout"
    assert cloudckpt_cli(["download", areal.save_root(saver_cfg), str(on_disk)]) == 0
    uri = areal.save_root(configs(s3, trial)[0])
    store = open_store(uri, s3.options)
    for path in sorted(p for p in on_disk.rglob("*") if p.is_file()):
        if path.name != "cloudckpt-manifest.json":
            store.put_file(path.relative_to(on_disk).as_posix(), path)
    return uri, _params(model)


def test_synced_areal_trial_is_refused_until_adopted(s3, tmp_path, caplog):
    from cloudckpt.cli import main as cloudckpt_cli
    from cloudckpt.errors import IncompleteCheckpointError

    uri, weights = _areal_trial_in_bucket(s3, tmp_path, "synced")
    store = open_store(uri, s3.options)
    theirs = {o.key: store.get(o.key) for o in store.list()}
    assert "recover_info/step_info.json" in theirs and "slot-pointer.json" not in theirs
    saver_cfg, recover_cfg = configs(s3, "synced")
    with pytest.raises(IncompleteCheckpointError) as err:
        areal.RecoverHandler(recover_cfg, 6, storage_options=s3.options)
    assert f"cloudckpt areal adopt {uri}" in str(err.value)

    assert cloudckpt_cli(["areal", "adopt", uri, *_cli_opts(s3)]) == 0
    assert {k: store.get(k) for k in theirs} == theirs  # AReaL's objects stay as they were
    fresh, fresh_optim = _tiny(seed=1)
    caplog.set_level(logging.WARNING, logger="cloudckpt")
    got = areal.RecoverHandler(recover_cfg, 6, storage_options=s3.options).load(
        areal.Engine(fresh, fresh_optim), None, None, None, None)
    assert got.last_step_info.global_step == 2 and _same(_params(fresh), weights)
    assert "starting from scratch" not in caplog.text
    assert [c.uri.rsplit("/", 1)[1] for c in areal.list_exports(
        saver_cfg, storage_options=s3.options)] == ["epoch0epochstep2globalstep2"]
    assert cloudckpt_cli(["areal", "adopt", uri, *_cli_opts(s3)]) == 2  # once is enough


def test_adopt_refuses_an_unfinished_areal_dump(s3, tmp_path):
    from cloudckpt.cli import main as cloudckpt_cli
    from cloudckpt.errors import CorruptCheckpointError
    from cloudckpt.training.slot import RecoverSlot

    uri, _ = _areal_trial_in_bucket(s3, tmp_path, "torn")
    store = open_store(uri, s3.options)
    shard = "default/recover_checkpoint/__0_0.distcp"
    store.put(shard, store.get(shard)[:100])  # AReaL overwrote it in place, and died
    store.delete(["recover_info/dataloader_info.pkl"])
    with pytest.raises(CorruptCheckpointError) as err:
        areal.adopt_trial(uri, storage_options=s3.options)
    assert set(err.value.problems) == {shard, "recover_info/dataloader_info.pkl"}
    assert "short" in err.value.problems[shard]
    assert not RecoverSlot(uri, storage_options=s3.options).exists()
    assert cloudckpt_cli(["areal", "adopt", s3.uri("nothing-here"), *_cli_opts(s3)]) == 3


def test_export_of_a_plain_module_needs_hf_config(s3):
    """A bare nn.Module without .config dumps, but cannot be exported: the error says
    to pass hf_config (the guide says so too), and nothing is committed."""
    saver_cfg, recover_cfg = configs(s3)
    saver = areal.Saver(replace(saver_cfg, freq_steps=1), 4, storage_options=s3.options)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"hf_config=") as err:
        saver.save(model, 0, 0, 0)
    assert "Linear" in str(err.value)
    assert areal.list_exports(saver_cfg, storage_options=s3.options) == []
    saver.save(areal.Engine(model, hf_config={"model_type": "linear-test"}), 0, 0, 0)
    assert [c.uri for c in areal.list_exports(saver_cfg, storage_options=s3.options)] == [
        saver.last_export]
    handler = areal.RecoverHandler(replace(recover_cfg, freq_steps=1), 4,
                                   storage_options=s3.options)
    handler.dump(model, StepInfo(0, 0, 0, 4), None, None, None, None)
    assert handler.slot.info()["step"] == 0


def test_the_bound_cycle_goes_on_from_the_resumed_epoch():
    """AReaL's cycle_dataloader counts epochs from 0 on every launch; the one activation
    binds counts from the epoch cloudckpt's handler restored, and is AReaL's otherwise."""
    from cloudckpt.integrations.areal.dataorder import cycle_from_resumed_epoch, mark_resumed

    class Sampler:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

    class Loader(list):
        def __init__(self) -> None:
            super().__init__([1, 2])
            self.sampler = Sampler()

    def areal_cycle(dataloader, num_cycles=-1):  # AReaL 1.0.4's, areal/utils/data.py
        epoch = 0
        while True:
            dataloader.sampler.set_epoch(epoch)
            yield from dataloader
            epoch += 1
            if num_cycles > 0 and epoch >= num_cycles:
                break

    cycle = cycle_from_resumed_epoch(areal_cycle)
    fresh, resumed = Loader(), Loader()
    assert list(cycle(fresh, 2)) == [1, 2, 1, 2] and fresh.sampler.epochs == [0, 1]
    mark_resumed(resumed, 3)
    assert list(cycle(resumed, 2)) == [1, 2, 1, 2] and resumed.sampler.epochs == [3, 4]
