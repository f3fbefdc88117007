"""verl's path keys besides its checkpoint root, and which of them cloudckpt cannot
place: verl writes them with local file calls (``os.makedirs``, ``open``), so a bucket
URI there becomes a local directory named ``s3:``. Activation refuses such a value at
the trainer's start (its ``_load_checkpoint``), and ``cloudckpt doctor`` says the same,
each naming the key and a local path to set instead. Plain data: no torch, no verl."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.runtime.localdirs import local_dir_for
from cloudckpt.storage import is_remote

#: PPO keys verl writes locally, and what each holds.
PPO_LOCAL = {
    "trainer.rollout_data_dir": "rollout dumps (JSONL, each logged step)",
    "trainer.validation_data_dir": "validation generations (JSONL)",
    "global_profiler.save_path": "profiler traces",
}


def suggestion(key: str, value: str, cwd: str | None = None) -> str:
    """A local path for ``key`` beside the run's other local files."""
    local = local_dir_for(value, cwd=cwd)
    return os.path.relpath(local, cwd or os.getcwd())


def problem(key: str, value: str, holds: str, cwd: str | None = None) -> str:
    """What activation says of a bucket URI at a key verl writes locally."""
    return (f"verl writes its {holds} at {key} with local file calls, which would make a "
            f"local directory named {value.split('://', 1)[0]}: instead of reaching the "
            f"bucket: set {key} to a local path, e.g. {key}={suggestion(key, value, cwd)}")


def unplaced(select: Callable[[str], Any]) -> list[tuple[str, str, str]]:
    """``(key, value, holds)`` of each :data:`PPO_LOCAL` key holding a bucket URI;
    ``select(key)`` reads a dotted key of the run's config (None where unset)."""
    out = []
    for key, holds in PPO_LOCAL.items():
        value = select(key)
        if is_remote(value):
            out.append((key, str(value), holds))
    return out


def refuse_unplaced(config: Any) -> None:
    """Raise :class:`ConfigError` for the first key verl would write to a local ``s3:``
    directory (``config``: the trainer's whole OmegaConf config)."""
    from omegaconf import OmegaConf

    for key, value, holds in unplaced(lambda k: OmegaConf.select(config, k, default=None)):
        raise ConfigError(problem(key, value, holds))
