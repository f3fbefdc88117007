"""What activation binds into RLinf, each for a bucket URI only (a local path runs
RLinf's own code, unchanged):

- ``FSDPStrategyBase.save_checkpoint`` / ``load_checkpoint`` (its FSDP workers'
  checkpoint I/O, both formats) commit and load a part (:mod:`.strategy`);
- ``ReasoningRunner._save_checkpoint`` commits the step (the parts and ``data.pt``),
  ``init_workers`` resolves ``resume_dir`` (``auto``) among committed steps, and
  ``init_actor_critic_workers`` loads ``data.pt`` from the bucket (:mod:`.runner`);
- ``output_redirector`` (``rlinf.utils.utils``), the decorator of RLinf's entry scripts
  (``examples/reasoning/main_grpo.py``...), the first of RLinf's code to see the config:
  the local paths it derives from a bucket become local directories (:mod:`.localpaths`)
  before anything reads them, and its own ``log/main.log`` goes there too.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from cloudckpt.runtime.localdirs import local_dir_for
from cloudckpt.storage import is_remote


def bind_launch(module: ModuleType) -> tuple[str, ...]:
    """Wrap ``rlinf.utils.utils.output_redirector``, before an entry script imports it."""
    own = module.output_redirector

    @functools.wraps(own)
    def output_redirector(func: Any) -> Any:
        @functools.wraps(func)
        def wrapper(cfg: Any, *args: Any, **kwargs: Any) -> Any:
            from omegaconf import OmegaConf

            from cloudckpt.integrations.rlinf.localpaths import localise

            if not OmegaConf.is_config(cfg):  # not Hydra's: nothing derives from it
                return own(func)(cfg, *args, **kwargs)
            localise(cfg)
            bucket = cfg.runner.output_dir
            if not is_remote(bucket):
                return own(func)(cfg, *args, **kwargs)
            if cfg.runner.get("resume_dir") is None:  # before RLinf starts its loggers
                from cloudckpt.integrations.rlinf.layout import checkpoints_root
                from cloudckpt.integrations.rlinf.runner import refuse_fresh_start

                refuse_fresh_start(checkpoints_root(bucket, cfg.runner.experiment_name))

            def inside(cfg: Any, *args: Any, **kwargs: Any) -> Any:
                cfg.runner.output_dir = bucket  # RLinf's log is open: the bucket again
                return func(cfg, *args, **kwargs)

            # RLinf opens {output_dir}/{experiment_name}/log/main.log before the run.
            cfg.runner.output_dir = local_dir_for(bucket)
            return own(functools.wraps(func)(inside))(cfg, *args, **kwargs)

        return wrapper

    module.output_redirector = output_redirector  # type: ignore[attr-defined]  # RLinf's
    return ("output_redirector",)


def bind_runner(module: ModuleType) -> tuple[str, ...]:
    """Wrap three methods of ``rlinf.runners.reasoning_runner``'s ``ReasoningRunner``."""
    cls = module.ReasoningRunner
    own_save, own_init = cls._save_checkpoint, cls.init_workers
    own_workers = cls.init_actor_critic_workers

    @functools.wraps(own_save)
    def _save_checkpoint(self: Any) -> None:
        if not is_remote(self.cfg.runner.output_dir):
            return own_save(self)
        from cloudckpt.integrations.rlinf.runner import save_step

        save_step(self)
        return None

    @functools.wraps(own_init)
    def init_workers(self: Any) -> Any:
        if is_remote(self.cfg.runner.output_dir) or is_remote(self.cfg.runner.resume_dir):
            from cloudckpt.integrations.rlinf.runner import resolve

            resolve(self)
        return own_init(self)

    @functools.wraps(own_workers)
    def init_actor_critic_workers(self: Any) -> Any:
        result = own_workers(self)
        if is_remote(self.cfg.runner.resume_dir):
            from cloudckpt.integrations.rlinf.runner import load_data

            load_data(self)
        return result

    cls._save_checkpoint = _save_checkpoint
    cls.init_workers = init_workers
    cls.init_actor_critic_workers = init_actor_critic_workers
    return ("ReasoningRunner._save_checkpoint", "ReasoningRunner.init_workers",
            "ReasoningRunner.init_actor_critic_workers")


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
        if not is_remote(save_path):
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
        if not is_remote(load_path):
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
