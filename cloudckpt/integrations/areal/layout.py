"""AReaL's layout: where a trial's files go and how they are named.

A trial lives at ``{fileroot}/checkpoints/{user}/{experiment}/{trial}``; in it, each
export is ``{name}/epoch{E}epochstep{S}globalstep{G}/``, and the recover state is
``{name}/recover_checkpoint/`` (one per engine) and ``recover_info/``."""

from __future__ import annotations

import getpass
import re
from typing import Any

EXPORT_RE = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)$")
INFO_DIR = "recover_info"


def save_root(cfg: Any) -> str:
    """``{fileroot}/checkpoints/{user}/{experiment}/{trial}``, as AReaL builds it, for
    AReaL's config objects or :mod:`.config`'s."""
    user = getattr(cfg, "user", None) or getpass.getuser()
    return "/".join([cfg.fileroot.rstrip("/"), "checkpoints", user, cfg.experiment_name,
                     cfg.trial_name])


def export_name(epoch: int, epoch_step: int, global_step: int) -> str:
    return f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"


def recover_checkpoint_uri(cfg: Any, name: str = "default") -> str:
    return f"{save_root(cfg)}/{name}/recover_checkpoint"


def recover_info_uri(cfg: Any) -> str:
    return f"{save_root(cfg)}/recover_info"


def is_recover_file(rel: str) -> bool:
    """Whether ``rel`` (relative to the trial directory) is part of AReaL's recover
    state: ``recover_info/*`` or ``{name}/recover_checkpoint/*``."""
    parts = rel.split("/")
    return (parts[0] == INFO_DIR and len(parts) > 1) or \
        (len(parts) > 2 and parts[1] == "recover_checkpoint")
