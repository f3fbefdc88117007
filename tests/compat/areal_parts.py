"""AReaL's own pieces for the compatibility tests, and the smallest stand-ins for
what needs a GPU cluster.

Real: ``SaverConfig``, ``RecoverConfig``, ``EvaluatorConfig``, ``FinetuneSpec``,
``StepInfo``, ``WeightUpdateMeta``, ``Evaluator``, ``SaveLoadMeta``, AReaL's
``Saver``/``RecoverHandler`` (the other side of each round trip), torchdata's
``StatefulDataLoader``, and AReaL's ``FSDPEngine`` code for ``save``/``load``.

Stand-ins, and why:
- the engine is an ``FSDPEngine`` made without ``__init__`` (which needs CUDA, a model
  path and AReaL's launcher), holding a tiny Llama and AdamW, unsharded, in a one-rank
  gloo group: ``save``, ``load``, ``_save_to_dcp``, ``_load_from_dcp`` and
  ``_save_model_to_hf`` that run are AReaL's own code;
- the weight push to an inference server (``connect_engine``, ``update_weights``) and
  the inference engine (SGLang/vLLM) are recorders: a server needs a GPU;
- ``StatsLogger`` needs wandb/tensorboard settings; a recorder keeps its one piece of
  recover state, ``last_commit_step``;
- AReaL's ``Saver.save`` asks whether the engine is an ``ArchonEngine``, whose module
  imports ``triton`` (a GPU compiler, not installed here): when that import fails, a
  placeholder module holds an ``ArchonEngine`` class that no engine here is.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

import torch
from areal.api.cli_args import EvaluatorConfig
from areal.api.io_struct import FinetuneSpec, StepInfo
from areal.engine.fsdp_engine import FSDPEngine
from areal.utils.evaluator import Evaluator
from torchdata.stateful_dataloader import StatefulDataLoader

try:
    import areal.experimental.engine.archon_engine  # noqa: F401
except ModuleNotFoundError as exc:
    assert exc.name == "triton", exc  # anything else missing is a real failure
    _archon = types.ModuleType("areal.experimental.engine.archon_engine")
    _archon.ArchonEngine = type("ArchonEngine", (), {})  # type: ignore[attr-defined]
    sys.modules[_archon.__name__] = _archon

BATCH, SAMPLES, SEQ = 2, 20, 8  # 10 steps per epoch: a run stays in epoch 0
FT_SPEC = FinetuneSpec(total_train_epochs=2, dataset_size=SAMPLES, train_batch_size=BATCH)


def tiny_lm() -> tuple[Any, Any]:
    """A tiny Llama and a tokenizer trained locally (no download)."""
    warnings.simplefilter("ignore")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=64,
                                                special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config), tokenizer


class Calls(list):
    """What the stand-ins were asked to do, in order."""


def fsdp_engine(calls: Calls | None = None) -> FSDPEngine:
    """AReaL's FSDPEngine around a fresh tiny model (same seed: same weights)."""
    model, _ = tiny_lm()
    eng = FSDPEngine.__new__(FSDPEngine)
    eng.model = model
    eng.model_config = model.config
    eng.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng.config = types.SimpleNamespace(use_lora=False)
    eng._initialized = True
    eng._cpu_group = None  # the default group
    eng.is_offload = False
    eng._offload_depth = 0
    eng._per_layer_optim_wrapper = None
    eng._compute_dtype = lambda: torch.float32
    eng._version = 0
    calls = calls if calls is not None else Calls()
    eng.connect_engine = lambda inf, meta: calls.append(("connect_engine", meta.version))
    eng.update_weights = lambda meta: calls.append(("update_weights", meta.version))
    eng.set_version = lambda v: calls.append(("engine.set_version", v))
    return eng


class InferenceEngine:
    """Records AReaL's post-recovery calls to the inference engine."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def pause(self) -> None:
        self.calls.append(("pause",))

    def resume(self) -> None:
        self.calls.append(("resume",))

    def set_version(self, v: int) -> None:
        self.calls.append(("inference.set_version", v))


class StatsLogger:
    """StatsLogger's recover state: the last committed step."""

    def __init__(self) -> None:
        self.last_commit_step = 0

    def state_dict(self) -> dict:
        return {"last_commit_step": self.last_commit_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_commit_step = state["last_commit_step"]


def dataloader() -> StatefulDataLoader:
    g = torch.Generator().manual_seed(7)
    data = torch.randint(3, 64, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
    return StatefulDataLoader(list(data), batch_size=BATCH, shuffle=True, generator=g,
                              drop_last=True)


def evaluator() -> Evaluator:
    return Evaluator(EvaluatorConfig(experiment_name="e", trial_name="t", fileroot="/x",
                                     freq_steps=3), FT_SPEC)


class Trainer:
    """AReaL's trainer loop (rl_trainer.py), reduced to its checkpoint calls."""

    def __init__(self, saver_cls: type, recover_cls: type, saver_cfg: Any, recover_cfg: Any,
                 **kw: Any) -> None:
        self.calls = Calls()
        self.actor = fsdp_engine(self.calls)
        _, self.tokenizer = tiny_lm()
        self.loader = dataloader()
        self.evaluator, self.stats_logger = evaluator(), StatsLogger()
        self.saver = saver_cls(saver_cfg, FT_SPEC, **kw)
        self.recover_handler = recover_cls(recover_cfg, FT_SPEC, **kw)
        self.batches: list[torch.Tensor] = []

    def recover(self, meta: Any = None) -> Any:
        return self.recover_handler.load(
            self.actor, self.saver, self.evaluator, self.stats_logger, self.loader,
            inference_engine=InferenceEngine(self.calls) if meta is not None else None,
            weight_update_meta=meta)

    def train(self, start: StepInfo, until: int) -> None:
        step = start
        it = iter(self.loader)
        while step.global_step < until:
            try:
                batch = next(it)
            except StopIteration:
                it = iter(self.loader)
                batch = next(it)
            self.batches.append(batch)
            model, optim = self.actor.model, self.actor.optimizer
            loss = model(input_ids=batch, labels=batch).loss
            optim.zero_grad()
            loss.backward()
            optim.step()
            self.saver.save(self.actor, step.epoch, step.epoch_step, step.global_step,
                            tokenizer=self.tokenizer, processor=None)
            self.recover_handler.dump(dict(default=self.actor), step, self.saver,
                                      self.evaluator, self.stats_logger, self.loader,
                                      tokenizer=self.tokenizer, processor=None)
            self.stats_logger.last_commit_step = step.global_step
            step = step.next()


def first_step() -> StepInfo:
    return StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=FT_SPEC.steps_per_epoch)


def assert_same_state(a: FSDPEngine, b: FSDPEngine) -> None:
    """Model and optimizer state bit-exact."""
    for (na, ta), (nb, tb) in zip(a.model.state_dict().items(), b.model.state_dict().items(),
                                  strict=True):
        assert na == nb and torch.equal(ta, tb), na
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[k][field], sb[k][field]), (k, field)
