"""What activation binds into RLinf: ``FSDPStrategyBase.save_checkpoint`` and
``load_checkpoint`` (its FSDP workers' checkpoint I/O, both formats) commit to and
load from a bucket when the path is a bucket URI (:mod:`.strategy`); a local path
runs RLinf's own code, unchanged."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from cloudckpt.storage import is_remote


def _remote(path: Any) -> bool:
    return isinstance(path, str) and is_remote(path)


def bind_strategy(module: ModuleType) -> tuple[str, ...]:
    """Wrap the two classmethods of ``rlinf.hybrid_engines.fsdp.strategy.base``'s
    ``FSDPStrategyBase``; RLinf's own ``Checkpoint`` state is what is saved."""
    cls = module.FSDPStrategyBase
    own_save = cls.__dict__["save_checkpoint"].__func__
    own_load = cls.__dict__["load_checkpoint"].__func__

    def training_state(strategy: Any, model: Any, optimizers: Any, lr_schedulers: Any,
                       checkpoint_format: str) -> Any:
        opts = module.StateDictOptions(full_state_dict=False, cpu_offload=True)
        return module.Checkpoint(model, optimizers, lr_schedulers, opts,
                                 fsdp_version=strategy.get_fsdp_version(),
                                 checkpoint_format=checkpoint_format)

    @functools.wraps(own_save)
    def save_checkpoint(strategy: Any, model: Any, optimizers: Any, lr_schedulers: Any,
                        save_path: str, save_full_model_weights: bool = True,
                        checkpoint_format: str = "dcp") -> None:
        if not _remote(save_path):
            return own_save(strategy, model, optimizers, lr_schedulers, save_path,
                            save_full_model_weights, checkpoint_format)
        from cloudckpt.integrations.rlinf.strategy import save_part

        module.clear_memory()
        state = training_state(strategy, model, optimizers, lr_schedulers, checkpoint_format)

        def full_weights() -> Any:  # RLinf's own gather (base.py), on every rank
            opts = module.StateDictOptions(full_state_dict=True, cpu_offload=True)
            return module.get_model_state_dict(model=model, options=opts)

        save_part(state, save_path, checkpoint_format=checkpoint_format,
                  full_weights=full_weights if save_full_model_weights else None)
        return None

    @functools.wraps(own_load)
    def load_checkpoint(strategy: Any, model: Any, optimizers: Any, lr_schedulers: Any,
                        load_path: str, checkpoint_format: str = "dcp") -> None:
        if not _remote(load_path):
            return own_load(strategy, model, optimizers, lr_schedulers, load_path,
                            checkpoint_format)
        from cloudckpt.integrations.rlinf.strategy import load_part

        state = training_state(strategy, model, optimizers, lr_schedulers, checkpoint_format)
        load_part(state, load_path, checkpoint_format=checkpoint_format,
                  fsdp_version=strategy.get_fsdp_version())
        import torch.distributed as dist

        dist.barrier()  # as RLinf's load ends
        return None

    cls.save_checkpoint = classmethod(save_checkpoint)
    cls.load_checkpoint = classmethod(load_checkpoint)
    return ("FSDPStrategyBase.save_checkpoint", "FSDPStrategyBase.load_checkpoint")
