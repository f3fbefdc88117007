"""The manifest kinds cloudckpt itself writes; frameworks declare theirs in
:mod:`cloudckpt.core.plugins`."""

from __future__ import annotations

#: Any committed prefix (a :class:`~cloudckpt.core.checkpoint.CheckpointWriter`'s default).
GENERIC = "generic"
#: A DCP checkpoint (:mod:`cloudckpt.dcp`).
DCP = "dcp"
#: A training checkpoint: a DCP model part, per-rank and shared state.
TRAINING = "training"
#: A Hugging Face export (:mod:`cloudckpt.hf`).
HF = "hf"
