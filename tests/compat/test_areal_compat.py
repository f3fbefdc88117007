"""AReaL 1.0.4's own classes drive cloudckpt's Saver and RecoverHandler, and each side
resumes what the other wrote, bit-exact (see areal_parts.py for the stand-ins)."""

from __future__ import annotations

import getpass
import inspect
import json
import os
import pickle
from pathlib import Path

import areal.utils.recover as areal_recover
import areal.utils.saver as areal_saver
import pytest
import torch
import torch.distributed as dist
from areal.api.cli_args import RecoverConfig, SaverConfig
from areal.api.io_struct import FinetuneSpec, StepInfo, WeightUpdateMeta
from areal_parts import FT_SPEC, Trainer, assert_same_state, first_step

from cloudckpt.cli import main as cloudckpt_cli
from cloudckpt.errors import (
    BucketNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from cloudckpt.integrations import areal
from cloudckpt.integrations.areal.info import load_pickle

STEPS, CUT = 8, 5  # train 8 steps; the interrupted run stops after step 4 (dumped at 3)


@pytest.fixture(scope="module", autouse=True)
def one_rank_gloo(tmp_path_factory):
    """AReaL's engine code calls torch.distributed: a real one-rank gloo group."""
    store = tmp_path_factory.mktemp("gloo") / "init"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def configs(fileroot: str, **recover: object) -> tuple[SaverConfig, RecoverConfig]:
    return (SaverConfig(experiment_name="exp", trial_name="trial", fileroot=fileroot,
                        freq_steps=3),
            RecoverConfig(experiment_name="exp", trial_name="trial", fileroot=fileroot,
                          mode="on", freq_steps=2, **recover))


def trial_dir(fileroot: str) -> str:
    return f"{fileroot.rstrip('/')}/checkpoints/{getpass.getuser()}/exp/trial"


def cli_options(backend) -> list[str]:
    return [f"{k}={v}" for k, v in backend.options.items() if k != "retry"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Trainer:
    """An uninterrupted run, nothing saved."""
    root = str(tmp_path_factory.mktemp("ref"))
    saver_cfg, recover_cfg = configs(root)
    saver_cfg.freq_steps, recover_cfg.mode = None, "disabled"
    run = Trainer(areal.Saver, areal.RecoverHandler, saver_cfg, recover_cfg)
    run.train(first_step(), STEPS)
    return run


def resume_and_finish(run: Trainer, reference: Trainer) -> object:
    calls_before = len(run.calls)
    info = run.recover(WeightUpdateMeta(type="disk", path="/unused"))
    assert info is not None
    assert info.last_step_info == StepInfo(epoch=0, epoch_step=3, global_step=3,
                                           steps_per_epoch=FT_SPEC.steps_per_epoch)
    # AReaL's weight push after recovery: version = last global step + 1, in this order.
    v = 4
    assert run.calls[calls_before:] == [("connect_engine", v), ("pause",),
                                        ("update_weights", v), ("resume",),
                                        ("engine.set_version", v),
                                        ("inference.set_version", v)]
    assert run.stats_logger.last_commit_step == 2  # committed before step 3's dump
    run.train(info.last_step_info.next(), STEPS)
    for got, want in zip(run.batches, reference.batches[v:], strict=True):
        assert torch.equal(got, want)  # the dataloader resumed mid-epoch
    assert_same_state(run.actor, reference.actor)
    return info


@pytest.mark.parametrize("where", ["s3", "gcs", "local"])
def test_cloudckpt_trial_downloaded_resumes_under_areal(where, request, tmp_path, reference):
    backend = request.getfixturevalue(where)
    saver_cfg, recover_cfg = configs(backend.root)
    first = Trainer(areal.Saver, areal.RecoverHandler, saver_cfg, recover_cfg,
                    storage_options=backend.options)
    first.train(first_step(), CUT)

    local_root = str(tmp_path / "areal")
    rc = cloudckpt_cli(["download", trial_dir(backend.root), trial_dir(local_root),
                        *[a for o in cli_options(backend) for a in ("-o", o)]])
    assert rc == 0
    local = Path(trial_dir(local_root))
    # AReaL's layout, file for file: recover state of step 3, exports of steps 2 and 5.
    assert (local / "default/recover_checkpoint/.metadata").is_file()
    assert json.loads((local / "recover_info/step_info.json").read_text())["global_step"] == 3
    assert sorted(p.name for p in (local / "default").iterdir()) == [
        "epoch0epochstep2globalstep2", "recover_checkpoint"]
    assert not list(local.glob("gen-*"))
    _, local_recover = configs(local_root)
    assert areal_recover.check_if_recover(local_recover, 0)  # AReaL's launcher agrees

    second = Trainer(areal_saver.Saver, areal_recover.RecoverHandler, *configs(local_root))
    info = resume_and_finish(second, reference)
    assert isinstance(info, areal_recover.RecoverInfo)


def _resumes_under_cloudckpt(s3, reference) -> None:
    """The trial in the bucket holds its one export, and cloudckpt's classes resume it
    and finish bit-exact against the reference run."""
    saver_cfg, recover_cfg = configs(s3.root)
    exports = areal.list_exports(saver_cfg, storage_options=s3.options)
    assert [Path(e.uri).name for e in exports] == ["epoch0epochstep2globalstep2"]
    assert "model.safetensors" in exports[0].files and "tokenizer.json" in exports[0].files

    second = Trainer(areal.Saver, areal.RecoverHandler, saver_cfg, recover_cfg,
                     storage_options=s3.options)
    info = resume_and_finish(second, reference)
    assert isinstance(info, areal_recover.RecoverInfo)


def test_areal_trial_imported_resumes_under_cloudckpt(s3, tmp_path, reference):
    local_root = str(tmp_path / "areal")
    first = Trainer(areal_saver.Saver, areal_recover.RecoverHandler, *configs(local_root))
    first.train(first_step(), CUT)

    opts = [a for o in cli_options(s3) for a in ("-o", o)]
    missing = str(tmp_path / "no-trial")
    assert cloudckpt_cli(["areal", "import", missing, trial_dir(s3.root), *opts]) == 3
    assert cloudckpt_cli(["areal", "import", trial_dir(local_root), trial_dir(s3.root), *opts]) == 0
    _resumes_under_cloudckpt(s3, reference)


def test_areal_trial_synced_into_a_bucket_is_refused_then_adopted(s3, tmp_path, reference):
    """A trial AReaL wrote, copied into the bucket as `aws s3 sync` does (AReaL's layout,
    no manifests): the handler refuses it (it would train from scratch beside it) and
    names the command; adopted, it resumes bit-exact."""
    from cloudckpt import open_store

    local_root = str(tmp_path / "areal")
    first = Trainer(areal_saver.Saver, areal_recover.RecoverHandler, *configs(local_root))
    first.train(first_step(), CUT)
    local, uri = Path(trial_dir(local_root)), trial_dir(s3.root)
    store = open_store(uri, s3.options)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        store.put_file(path.relative_to(local).as_posix(), path)

    saver_cfg, recover_cfg = configs(s3.root)
    with pytest.raises(IncompleteCheckpointError) as err:
        Trainer(areal.Saver, areal.RecoverHandler, saver_cfg, recover_cfg,
                storage_options=s3.options)
    assert f"cloudckpt areal adopt {uri}" in str(err.value)
    opts = [a for o in cli_options(s3) for a in ("-o", o)]
    assert cloudckpt_cli(["areal", "adopt", uri, *opts]) == 0
    _resumes_under_cloudckpt(s3, reference)


def test_missing_bucket_in_areals_config_is_refused_at_construction(s3):
    saver_cfg, recover_cfg = configs("s3://no-such-bucket-areal/experiments")
    for cls, cfg in ((areal.Saver, saver_cfg), (areal.RecoverHandler, recover_cfg)):
        with pytest.raises(BucketNotFoundError, match="no-such-bucket-areal") as err:
            cls(cfg, FT_SPEC, storage_options=s3.options)
        assert f"{type(cfg).__name__}.fileroot" in str(err.value)


@pytest.mark.parametrize("incremental", [False, True])
def test_export_is_what_areal_exports(s3, tmp_path, monkeypatch, incremental):
    """The same step exported by AReaL (local) and by cloudckpt (bucket), through the
    same engine: the same files and the same bytes. Exported incrementally too
    ($CLOUDCKPT_INCREMENTAL: every file a blob), it downloads as AReaL's own files."""
    import safetensors.torch

    from cloudckpt import open_checkpoint
    from cloudckpt.movement.checkpoint_copy import download

    monkeypatch.setenv("CLOUDCKPT_INCREMENTAL", "1" if incremental else "0")
    mine = Trainer(areal.Saver, areal.RecoverHandler, *configs(s3.root),
                   storage_options=s3.options)
    theirs = Trainer(areal_saver.Saver, areal_recover.RecoverHandler,
                     *configs(str(tmp_path)))
    mine.train(first_step(), 3)
    theirs.train(first_step(), 3)
    ckpt = open_checkpoint(mine.saver.last_export, s3.options)
    local = Path(trial_dir(str(tmp_path))) / "default" / "epoch0epochstep2globalstep2"
    assert sorted(ckpt.files) == sorted(p.name for p in local.iterdir())
    for name in ckpt.files:
        if name.endswith(".safetensors"):
            got = safetensors.torch.load(ckpt.read(name))
            want = safetensors.torch.load_file(str(local / name))
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in got)
        elif name.endswith(".json") and name != "config.json":
            assert json.loads(ckpt.read(name)) == json.loads((local / name).read_text())
    assert (ckpt.manifest.blob_depth == 1) is incremental
    got = download(ckpt, tmp_path / "downloaded")
    for name in ckpt.files:
        if name.endswith(".safetensors") or name.startswith("tokenizer"):
            assert (got / name).read_bytes() == (local / name).read_bytes(), name


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("cls, method", [
    ("Saver", "__init__"), ("Saver", "save"), ("Saver", "get_save_root"),
    ("Saver", "get_model_save_root"), ("Saver", "get_model_save_path"),
    ("Saver", "get_recover_checkpoint_path"), ("Saver", "state_dict"),
    ("Saver", "load_state_dict"), ("Saver", "maybe_wait_for_staging"), ("Saver", "finalize"),
    ("RecoverHandler", "__init__"), ("RecoverHandler", "dump"), ("RecoverHandler", "load"),
    ("RecoverHandler", "recover_info_path"),
])
def test_every_method_takes_areals_arguments(cls, method):
    """AReaL's parameters, names, kinds and defaults, in AReaL's positions; ours may
    only add keyword-only ones after them."""
    theirs = _params(getattr(getattr(areal_saver if cls == "Saver" else areal_recover, cls),
                             method))
    ours = _params(getattr(getattr(areal, cls), method))
    assert ours[:len(theirs)] == theirs
    assert all(kind == inspect.Parameter.KEYWORD_ONLY for _, kind, _ in ours[len(theirs):])


def test_areal_config_objects_and_spec(tmp_path):
    saver_cfg, recover_cfg = configs(str(tmp_path), no_save_optim=True, no_load_optim=True)
    empty = FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=4)
    assert empty.steps_per_epoch == 0  # a dataset smaller than a batch
    saver = areal.Saver(saver_cfg, empty)
    handler = areal.RecoverHandler(recover_cfg, empty)
    assert handler.last_step_info == StepInfo(-1, -1, -1, 0)
    assert type(handler.last_step_info) is StepInfo
    assert saver.is_async is False
    saver.maybe_wait_for_staging()
    saver.finalize()
    root = areal.Saver.get_model_save_root("exp", "trial", str(tmp_path))
    assert root == areal_saver.Saver.get_model_save_root("exp", "trial", str(tmp_path))
    assert os.path.isdir(root)  # a local path is created, as AReaL does
    assert areal.RecoverHandler.recover_info_path("exp", "trial", "s3://b/r") == \
        f"s3://b/r/checkpoints/{getpass.getuser()}/exp/trial/recover_info"
    ours = areal.RecoverConfig.from_dict({"experiment_name": "e", "trial_name": "t",
                                          "no_save_optim": True, "no_load_optim": False})
    assert ours.no_save_optim is True


def test_no_save_optim_writes_the_model_only(s3, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    run = Trainer(areal.Saver, areal.RecoverHandler, *configs(s3.root, no_save_optim=True),
                  storage_options=s3.options)
    run.train(first_step(), 2)
    assert cloudckpt_cli(["download", trial_dir(s3.root), str(tmp_path / "t"),
                          *[a for o in cli_options(s3) for a in ("-o", o)]]) == 0
    keys = FileSystemReader(str(tmp_path / "t/default/recover_checkpoint")).read_metadata()
    names = set(keys.state_dict_metadata)
    assert any(k.startswith("dcp.model.") for k in names)
    assert not any(k.startswith("dcp.optim.") for k in names)  # AReaL's own keys


def _weights(engine) -> list[torch.Tensor]:
    return [t.detach().clone() for t in engine.model.state_dict().values()]


def test_no_save_optim_records_weights_and_a_resume_loading_optim_is_refused(
        s3, tmp_path, monkeypatch, caplog):
    """A dump under ``no_save_optim`` records the ``weights`` profile. A handler with
    ``no_load_optim: false`` (AReaL's default) resuming it is refused before anything is
    applied, naming the key and the switch; with $CLOUDCKPT_ALLOW_PARTIAL_RESUME=1 it
    loads the model and warns that the optimizer starts fresh; with ``no_load_optim:
    true`` (AReaL's own way) it loads the same without a warning."""
    from cloudckpt import open_checkpoint
    from cloudckpt.core import profiles
    from cloudckpt.errors import PartialCheckpointError

    saved = Trainer(areal.Saver, areal.RecoverHandler, *configs(s3.root, no_save_optim=True),
                    storage_options=s3.options)
    saved.train(first_step(), 2)  # dumped at step 1
    gen = areal.RecoverHandler(configs(s3.root)[1], FT_SPEC,
                               storage_options=s3.options).slot.current()
    assert open_checkpoint(gen.uri, s3.options).metadata["profile"] == \
        {"name": "weights", "lacks": ["optimizer"]}

    monkeypatch.delenv("CLOUDCKPT_ALLOW_PARTIAL_RESUME", raising=False)
    refused = Trainer(areal.Saver, areal.RecoverHandler, *configs(s3.root),
                      storage_options=s3.options)
    before = _weights(refused.actor)
    with pytest.raises(PartialCheckpointError) as err:
        refused.recover()
    assert "is a 'weights' save: it holds no optimizer" in str(err.value)
    assert "set recover.no_load_optim: true, or set CLOUDCKPT_ALLOW_PARTIAL_RESUME=1" in \
        str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(refused.actor), strict=True))
    assert refused.recover_handler.last_step_info.global_step == -1

    for allow, no_load_optim in ((True, False), (False, True)):
        monkeypatch.setenv("CLOUDCKPT_ALLOW_PARTIAL_RESUME", "1" if allow else "0")
        run = Trainer(areal.Saver, areal.RecoverHandler,
                      *configs(s3.root, no_load_optim=no_load_optim), storage_options=s3.options)
        caplog.clear()
        # on the logger itself: AReaL's logging set-up gives logging a new root and
        # manager, and pytest's capture handler sits on the new root only
        profiles.log.addHandler(caplog.handler)
        try:
            info = run.recover()
        finally:
            profiles.log.removeHandler(caplog.handler)
        assert info.last_step_info.global_step == 1
        # the saved run's last step (1) is its dump's: the model is back bit-exact
        assert all(torch.equal(a, b) for a, b in
                   zip(_weights(run.actor), _weights(saved.actor), strict=True))
        assert not run.actor.optimizer.state_dict()["state"]  # the optimizer starts fresh
        partial = [r.getMessage() for r in caplog.records if "partial resume" in r.getMessage()]
        assert bool(partial) is allow, partial
        if allow:
            assert "optimizer start(s) fresh" in partial[0]


def test_dataloader_pickle_allow_list(tmp_path):
    """AReaL's own dataloader_info.pkl loads; a pickle that would run code does not."""
    local_root = str(tmp_path / "areal")
    run = Trainer(areal_saver.Saver, areal_recover.RecoverHandler, *configs(local_root))
    run.train(first_step(), 2)
    raw = (Path(trial_dir(local_root)) / "recover_info/dataloader_info.pkl").read_bytes()
    (tmp_path / "x.pkl").write_bytes(raw)
    with pytest.raises(Exception):  # noqa: B017 - why the allow-list: torch refuses it
        torch.load(tmp_path / "x.pkl", weights_only=True)
    got, want = load_pickle(raw, "areal"), pickle.loads(raw)
    assert got[0].keys() == want[0].keys()
    got_gen = got[0]["_sampler_iter_state"]["sampler_iter_state"]["generator"]
    want_gen = want[0]["_sampler_iter_state"]["sampler_iter_state"]["generator"]
    assert isinstance(got_gen, torch.Tensor) and torch.equal(got_gen, want_gen)

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(CorruptCheckpointError, match="posix.system|os.system|not allowed"):
        load_pickle(pickle.dumps([{"x": Evil()}]), "evil.pkl")
    assert not marker.exists()


def areal_sections(text: str) -> dict[str, object]:
    """``saver`` and ``recover`` of a YAML document as AReaL's own load_expr_config builds
    them: OmegaConf reads and resolves it, AReaL's dataclasses validate each section."""
    from omegaconf import OmegaConf

    doc = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    built = {}
    for name, cls in (("saver", SaverConfig), ("recover", RecoverConfig)):
        section = {"experiment_name": "e", "trial_name": "t", **doc[name]}
        built[name] = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), section))
    return built


def test_the_example_config_is_what_areal_own_loader_accepts(tmp_path):
    """examples/areal/config.yaml (the loop of one's own), as written: AReaL accepts it,
    and cloudckpt's load_yaml reads the same values. A bare ``on`` is refused by both
    (outside activation). The guide's recipe is run whole by test_areal_onekey.py."""
    repo = Path(__file__).resolve().parents[2]
    text = (repo / "examples/areal/config.yaml").read_text()
    built = areal_sections(text)
    assert built["recover"].mode == "on" and "://" in built["recover"].fileroot
    assert "://" in built["saver"].fileroot
    assert "://" not in cluster_fileroot(text)  # AReaL's logs stay local
    saver, recover = areal.load_yaml(repo / "examples/areal/config.yaml")
    assert (saver.fileroot, recover.fileroot, recover.mode) == (
        built["saver"].fileroot, built["recover"].fileroot, built["recover"].mode)
    bare = text.replace('mode: "on"', "mode: on")
    with pytest.raises(ValueError, match="Invalid recover mode 'True'"):
        areal_sections(bare)
    path = tmp_path / "bare.yaml"
    path.write_text(bare)
    with pytest.raises(ConfigError, match='quote it, mode: "on"'):
        areal.load_yaml(path)


def cluster_fileroot(text: str) -> str:
    from omegaconf import OmegaConf

    return str(OmegaConf.create(text).cluster.fileroot)
