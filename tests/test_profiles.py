"""Save profiles in the manager: what a full, weights or adapters save holds, what a
resume from each does, and how the profiles keep apart (names, schedules, retention)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from dist_run import run_ranks
from tier_workers import Position

from cloudckpt import (
    CheckpointManager,
    ConfigError,
    ManagerOptions,
    PartialCheckpointError,
    StepInfo,
    list_checkpoints,
    open_checkpoint,
)
from cloudckpt.contents.inventory import list_contents
from cloudckpt.runtime.state import loads_state


class Lora(torch.nn.Module):
    """A frozen base layer with a small trainable LoRA beside it."""

    def __init__(self, size: int = 32, rank: int = 4) -> None:
        super().__init__()
        self.base = torch.nn.Linear(size, size)
        self.base.requires_grad_(False)
        self.lora_A = torch.nn.Linear(size, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, size, bias=False)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.lora_B(self.lora_A(x))


def trained(model: torch.nn.Module, seed: int = 0) -> torch.optim.Optimizer:
    """An Adam optimizer of ``model``'s trainable parameters after one step (so that it
    holds two moments per parameter)."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(4, model.base.in_features if hasattr(model, "base")
                      else model.in_features)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def frozen(obj) -> dict:
    """A deep copy of ``obj``'s state, to compare against later."""
    return copy.deepcopy(obj.state_dict())


def equal(a, b) -> bool:
    """Bit-exact equality of two nested states."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def info(step: int) -> StepInfo:
    return StepInfo(epoch_step=step, global_step=step, steps_per_epoch=100)


def names(contents) -> set[str]:
    return {e.name for e in contents.entries}


def test_a_weights_save_holds_the_model_only_and_a_resume_passes_over_it(s3, caplog):
    """Over S3: a full save and a newer weights save of a model trained with Adam. The
    weights save holds the model's tensors only (no optimizer, RNG, data position or
    extra), records what it lacks, and is at most 0.4x the full one; a resume takes the
    full one, saying it passed over the newer weights save, and restores it bit-exact."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = trained(model)
    mgr = CheckpointManager(s3.root, ManagerOptions(), storage_options=s3.options)
    what = {"per_rank": {"data": Position(7)}, "extra": {"note": {"lr": 0.1}}}
    assert mgr.save(info(10), {"model": model, "optim": opt}, force=True, **what)
    saved_model, saved_opt = frozen(model), frozen(opt)
    with torch.no_grad():
        model.weight.add_(1.0)  # the weights save holds other weights than the full one
    assert mgr.save(info(11), {"model": model, "optim": opt}, force=True, profile="weights",
                    **what)
    mgr.close()

    full = open_checkpoint(s3.uri("step-10"), s3.options)
    weights = open_checkpoint(s3.uri("weights-step-11"), s3.options)
    assert full.manifest.metadata["profile"] == {"name": "full", "lacks": []}
    assert weights.manifest.metadata["profile"] == {
        "name": "weights", "lacks": ["data", "note", "optim", "rng"]}
    assert weights.step == 11

    full_names, weights_names = names(list_contents(full)), names(list_contents(weights))
    assert weights_names == {"model.weight", "model.bias"}
    assert {"optim.state.0.exp_avg", "optim.state.0.exp_avg_sq"} <= full_names
    assert weights_names < full_names
    rank_state = loads_state(weights.read("state/rank-00000.bin"))
    shared = loads_state(weights.read("state/shared.bin"))
    assert rank_state == {}  # no RNG, no data loader position
    assert "note" not in shared and shared["__step_info__"]["global_step"] == 11
    assert {"__rng__", "data"} <= set(loads_state(full.read("state/rank-00000.bin")))
    assert "note" in loads_state(full.read("state/shared.bin"))

    ratio = weights.total_size / full.total_size
    assert ratio <= 0.4, (weights.total_size, full.total_size)

    torch.manual_seed(1)
    model2 = torch.nn.Linear(256, 256)
    opt2 = trained(model2, seed=1)
    data, note = Position(), {}
    resumer = CheckpointManager(s3.root, ManagerOptions(), storage_options=s3.options)
    with caplog.at_level(logging.INFO, logger="cloudckpt"):
        got = resumer.restore({"model": model2, "optim": opt2}, per_rank={"data": data},
                              extra={"note": _Note(note)})
    assert got is not None and got.global_step == 10
    assert equal(model2.state_dict(), saved_model) and equal(opt2.state_dict(), saved_opt)
    assert data.n == 7 and note == {"lr": 0.1}
    assert "passing over newer partial save(s) weights-step-11" in caplog.text


class _Note:
    """Extra state restored into a dict."""

    def __init__(self, into: dict) -> None:
        self.into = into

    def state_dict(self) -> dict:
        return dict(self.into)

    def load_state_dict(self, state: dict) -> None:
        self.into.update(state)


def test_an_adapters_save_holds_only_the_trainable_parameters(memory):
    """A module: its parameters with requires_grad (not the frozen base, not the
    buffer); a mapping of tensors: the names the filter takes (``lora_`` by default)."""
    torch.manual_seed(0)
    model = Lora()
    opt = trained(model)
    mgr = CheckpointManager(memory.root)
    mgr.save(info(1), {"model": model, "optim": opt}, force=True, profile="adapters")
    mgr.save(info(2), {"model": model.state_dict(), "optim": opt.state_dict()}, force=True,
             profile="adapters")
    for name in ("adapters-step-1", "adapters-step-2"):
        ckpt = open_checkpoint(memory.uri(name))
        assert names(list_contents(ckpt)) == {"model.lora_A.weight", "model.lora_B.weight"}
        assert ckpt.manifest.metadata["profile"] == {
            "name": "adapters", "lacks": ["frozen weights", "optim", "rng"]}
    mgr.save(info(5), {"model": model, "optim": opt}, force=True, profile="weights")
    assert open_checkpoint(memory.uri("adapters-step-1")).total_size < \
        open_checkpoint(memory.uri("weights-step-5")).total_size

    custom = CheckpointManager(memory.root, ManagerOptions(
        adapter_filter=lambda n: n.startswith("lora_B")))
    custom.save(info(3), {"model": model.state_dict()}, force=True, profile="adapters")
    assert names(list_contents(open_checkpoint(memory.uri("adapters-step-3")))) == {
        "model.lora_B.weight"}


def test_an_adapters_save_with_nothing_to_save_is_refused(memory):
    mgr = CheckpointManager(memory.root)
    plain = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ConfigError, match="holds no adapter to save.*requires_grad"):
        mgr.save(info(1), {"model": plain}, force=True, profile="adapters")
    with pytest.raises(ConfigError, match="holds no adapter to save.*adapter_filter"):
        mgr.save(info(1), {"model": torch.nn.Linear(4, 4).state_dict()}, force=True,
                 profile="adapters")
    with pytest.raises(ConfigError, match=r"state\['model'\] is a int"):
        mgr.save(info(1), {"model": 3}, force=True, profile="adapters")
    assert list_checkpoints(memory.root) == []


def test_an_adapters_resume_loads_the_adapter_and_keeps_the_frozen_weights(memory, caplog):
    torch.manual_seed(0)
    model = Lora()
    opt = trained(model)
    mgr = CheckpointManager(memory.root)
    mgr.save(info(4), {"model": model, "optim": opt}, force=True, profile="adapters")

    torch.manual_seed(5)
    other = Lora()
    other_opt = trained(other, seed=5)
    base, scale, opt_before = frozen(other.base), other.scale.clone(), frozen(other_opt)
    with pytest.raises(PartialCheckpointError, match="frozen weights"):
        mgr.restore({"model": other, "optim": other_opt}, uri="adapters-step-4")
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        got = mgr.restore({"model": other, "optim": other_opt}, uri="adapters-step-4",
                          allow_partial=True)
    assert got is not None and got.global_step == 4
    assert equal(other.lora_A.state_dict(), model.lora_A.state_dict())
    assert equal(other.lora_B.state_dict(), model.lora_B.state_dict())
    assert equal(other.base.state_dict(), base) and torch.equal(other.scale, scale)
    assert equal(other_opt.state_dict(), opt_before)
    assert other.lora_A.weight.requires_grad  # still the module's own parameter
    assert "frozen weights, optim, rng start(s) fresh" in caplog.text


def test_a_partial_resume_is_refused_and_changes_nothing(memory):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = trained(model)
    mgr = CheckpointManager(memory.root)
    mgr.save(info(3), {"model": model, "optim": opt}, force=True, profile="weights",
             per_rank={"data": Position(3)})
    torch.manual_seed(9)
    other = torch.nn.Linear(16, 16)
    other_opt = trained(other, seed=9)
    data = Position(42)
    before = frozen(other), frozen(other_opt)
    rng = torch.get_rng_state()
    with pytest.raises(PartialCheckpointError) as err:
        mgr.restore({"model": other, "optim": other_opt}, uri="weights-step-3",
                    per_rank={"data": data})
    says = str(err.value)
    assert "'weights' save" in says and "data, optim, rng" in says
    assert "restore(..., allow_partial=True)" in says
    assert equal(frozen(other), before[0]) and equal(frozen(other_opt), before[1])
    assert data.n == 42 and torch.equal(torch.get_rng_state(), rng)


def test_an_allowed_partial_resume_loads_the_model_and_leaves_the_rest(memory, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = trained(model)
    mgr = CheckpointManager(memory.root)
    mgr.save(info(3), {"model": model, "optim": opt}, force=True, profile="weights",
             per_rank={"data": Position(3)}, extra={"note": {"k": 1}})
    torch.manual_seed(9)
    other = torch.nn.Linear(16, 16)
    other_opt = trained(other, seed=9)
    data, note = Position(42), {}
    opt_before = frozen(other_opt)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        got = mgr.restore({"model": other, "optim": other_opt}, uri="weights-step-3",
                          per_rank={"data": data}, extra={"note": _Note(note)},
                          allow_partial=True)
    assert got is not None and got.global_step == 3
    assert equal(other.state_dict(), model.state_dict())  # bit-exact
    assert equal(other_opt.state_dict(), opt_before)  # untouched
    assert data.n == 42 and note == {}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("weights-step-3" in w and "data, note, optim, rng start(s) fresh" in w
               for w in warned), warned

    # A plain state dict as the model's entry is loaded into as well.
    plain = torch.nn.Linear(16, 16).state_dict()
    mgr.restore({"model": plain}, uri="weights-step-3", rng=False)  # lacks nothing it loads
    assert equal(plain, model.state_dict())


def test_latest_resume_takes_the_newest_save_that_holds_what_it_loads(memory, caplog):
    """Full saves every 2nd step, weights saves in between: the resume of the whole
    state takes the newest full one; allow_partial the newest of any; a resume of the
    model alone the newest weights save, as it holds all that resume loads."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = trained(model)
    mgr = CheckpointManager(memory.root, ManagerOptions(every_steps=2, weights_every_steps=1))
    kept = {}
    for step in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(info(step), {"model": model, "optim": opt})
        kept[step] = frozen(model)
    assert [c.name for c in list_checkpoints(memory.root)] == [
        "weights-step-0", "step-1", "weights-step-2"]

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m = torch.nn.Linear(8, 8)
        return m, trained(m, seed=3)

    m, o = fresh()
    with caplog.at_level(logging.INFO, logger="cloudckpt"):
        assert mgr.restore({"model": m, "optim": o}).global_step == 1
    assert equal(m.state_dict(), kept[1])
    assert "passing over newer partial save(s) weights-step-2" in caplog.text

    m, o = fresh()
    assert mgr.restore({"model": m, "optim": o}, allow_partial=True).global_step == 2
    assert equal(m.state_dict(), kept[2])

    m, _ = fresh()
    assert mgr.restore({"model": m}, rng=False).global_step == 2
    assert equal(m.state_dict(), kept[2])


def test_only_partial_saves_is_a_warning_and_no_resume(memory, caplog):
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(memory.root, ManagerOptions(weights_every_steps=1))
    mgr.save(info(0), {"model": model, "optim": trained(model)})
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert mgr.restore({"model": model, "optim": trained(model)}) is None
    assert "only partial saves (weights-step-0)" in caplog.text


def test_retention_keeps_each_profile_apart(memory):
    """keep_last=1 keeps the newest full save and the newest weights save: neither
    kind's saves count toward, or are deleted for, the other's (async saves, as the
    weights saves' staging takes the selected state only)."""
    model = torch.nn.Linear(4, 4)
    opt = trained(model)
    mgr = CheckpointManager(memory.root, ManagerOptions(every_steps=3, weights_every_steps=1,
                                                        keep_last=1, async_save=True))
    for step in range(7):
        mgr.save(info(step), {"model": model, "optim": opt})
    mgr.close()
    # full at steps 2 and 5; weights at 0, 1, 3, 4, 6
    assert [c.name for c in list_checkpoints(memory.root)] == ["step-5", "weights-step-6"]
    assert mgr.latest().step == 5 and mgr.latest("weights").step == 6


def test_a_local_tier_saves_full_beside_the_weights_saves(memory, tmp_path):
    """The local tier's saves stay full; a step both it and the weights schedule take
    gets both saves."""
    from cloudckpt import LocalTier

    model = torch.nn.Linear(4, 4)
    opt = trained(model)
    tier = LocalTier(str(tmp_path / "local"), every_steps=1)
    mgr = CheckpointManager(memory.root, ManagerOptions(weights_every_steps=2, local=tier))
    for step in range(4):
        mgr.save(info(step), {"model": model, "optim": opt})
    mgr.close()
    bucket = [c.name for c in list_checkpoints(memory.root)]
    assert "weights-step-1" in bucket and "weights-step-3" in bucket
    local = list_checkpoints(str(tmp_path / "local" / "rank-00000"))
    assert [c.name for c in local][-1] == "step-3"
    assert all("profile" not in (c.manifest.metadata or {}) for c in local)  # full
    assert "optim.state.0.exp_avg" in names(list_contents(open_checkpoint(
        str(tmp_path / "local" / "rank-00000" / "step-3"))))


def test_bad_profiles_and_model_keys_are_refused(memory):
    with pytest.raises(ConfigError, match="unknown save profile 'weight'"):
        ManagerOptions(profile="weight")
    with pytest.raises(ConfigError, match="model_keys must be a non-empty tuple"):
        ManagerOptions(model_keys="model")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="weights_every_steps must be positive"):
        ManagerOptions(weights_every_steps=0)
    mgr = CheckpointManager(memory.root)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="unknown save profile 'lora'"):
        mgr.save(info(1), {"model": model}, force=True, profile="lora")
    with pytest.raises(ConfigError, match=r"model_keys=\('model',\).*entries are "
                                          r"\['net', 'optim'\]"):
        mgr.save(info(1), {"net": model, "optim": trained(model)}, force=True,
                 profile="weights")
    assert list_checkpoints(memory.root) == []
    named = CheckpointManager(memory.root, ManagerOptions(model_keys=("net",)))
    named.save(info(1), {"net": model, "optim": trained(model)}, force=True, profile="weights")
    assert names(list_contents(open_checkpoint(memory.uri("weights-step-1")))) == {
        "net.weight", "net.bias"}


def test_a_partial_resume_is_refused_on_every_rank(s3):
    """Two gloo ranks: each refuses the weights save with PartialCheckpointError and
    keeps its state; allowed, each loads the saved model and keeps its optimizer; the
    latest resume of the whole state takes the full save on both."""
    ranks = run_ranks("profile_workers.refused_everywhere", 2, s3.root, s3.options,
                      timeout=240)
    for rank, out in ranks.items():
        assert out["refused"] == "PartialCheckpointError", (rank, out)
        assert out["untouched"] and out["allowed_model"] and out["allowed_optim_kept"], out
        assert out["latest_step"] == 1, out


def test_the_integrations_partial_resume_switch_takes_yes_or_no(monkeypatch):
    from cloudckpt.integrations import ALLOW_PARTIAL_ENV, partial_allowed

    monkeypatch.delenv(ALLOW_PARTIAL_ENV, raising=False)
    assert partial_allowed() is False
    monkeypatch.setenv(ALLOW_PARTIAL_ENV, "1")
    assert partial_allowed() is True
    monkeypatch.setenv(ALLOW_PARTIAL_ENV, "maybe")
    with pytest.raises(ConfigError, match="CLOUDCKPT_ALLOW_PARTIAL_RESUME='maybe': set it to 1"):
        partial_allowed()
