"""Gloo rank workers for tests/test_save_checks.py (module level, for spawn)."""

from __future__ import annotations

import json

import numpy as np
import torch

import cloudckpt.dcp as cdcp
from cloudckpt import ConfigError


def save_with_bad_value_on_one_rank(rank: int, world: int, uri: str, options: str) -> str:
    """Rank 1 alone holds a numpy array; every rank must raise, none may hang."""
    state = {"w": torch.full((4,), float(rank)), "extra": {"note": "plain"}}
    if rank == 1:
        state["extra"]["arr"] = np.arange(3)
    try:
        cdcp.save(state, f"{uri}/dcp", storage_options=json.loads(options))
    except ConfigError as exc:
        return str(exc)
    return "saved"
