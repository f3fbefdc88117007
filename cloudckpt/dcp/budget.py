"""Async saves within a host staging budget.

An async save copies the state to host memory so that training can go on while
it uploads. Copying a state larger than the host can spare is how nodes get
OOM-killed, so :class:`BudgetStager` copies at most ``budget`` bytes of tensors
(pinned host buffers when they come from a GPU, kept and reused from one save to
the next). What does not fit stays where it is: the writer uploads those live
tensors first, straight from their memory within the upload window, and only
then lets the caller go on (:meth:`StagedState.wait`). Training therefore blocks
for about (state - budget) / upload rate, and host memory stays within the
budget plus the upload window.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cloudckpt.compat.torch_private import (
    copy_state_dict,
    create_cpu_state_dict,
    flatten_state_dict,
    unflatten_state_dict,
)
from cloudckpt.errors import ConfigError
from cloudckpt.runtime.state import local_tensor, resolve_stateful

log = logging.getLogger(__name__)

#: Share of the host's physical memory the default budget takes, split between the
#: host's ranks (``LOCAL_WORLD_SIZE``).
DEFAULT_BUDGET_FRACTION = 0.25


def default_budget() -> int:
    """A quarter of the host's physical memory, divided by ``LOCAL_WORLD_SIZE``."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return int(total * DEFAULT_BUDGET_FRACTION) // ranks


@dataclass(eq=False)
class StagedState:
    """What an async save uploads: the state with up to the budget's worth of tensors
    replaced by host copies; the others are still the caller's live tensors."""

    state_dict: dict[str, Any]
    #: Storages (``data_ptr``) of the host copies: every other tensor is live.
    staged_storages: frozenset[int]
    staged_bytes: int
    live_bytes: int
    _released: threading.Event = field(default_factory=threading.Event)

    def is_staged(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (an item of the state, or a view of one) is a host copy."""
        return local_tensor(tensor).untyped_storage().data_ptr() in self.staged_storages

    def release(self) -> None:
        """The live tensors are no longer needed: written, or the save has failed."""
        self._released.set()

    def wait(self) -> None:
        """Block until the live tensors are written (at once when everything fit)."""
        if self.live_bytes:
            self._released.wait()


class BudgetStager:
    """Stages up to ``budget`` bytes of a state's tensors in host memory; the buffers
    are kept for the next save of the same shapes (pass one stager to every save).

    From a GPU the buffers are pinned and the copies non-blocking, so a save blocks
    its caller for the device-to-host copies at the link's speed; pinning is slow (a
    few hundred ms per GiB), so it is done once: ``allocations`` counts the times
    buffers were made (the first save, and a save whose layout changed), and
    ``pinned_bytes`` is what they hold pinned."""

    def __init__(self, budget: int | None = None) -> None:
        if budget is not None and budget < 0:
            raise ConfigError(f"staging budget must be >= 0 bytes, not {budget}")
        self.budget = default_budget() if budget is None else budget
        self._layout: dict[str, tuple[Any, ...]] = {}
        self._buffers: dict[str, Any] = {}
        self.allocations = 0
        self.pinned_bytes = 0

    def stage(self, state_dict: Mapping[str, Any]) -> StagedState:
        """Copy what fits in the budget (tensors in order, each that still fits) and
        every non-tensor value; the rest stays live. Returns once the copies are done."""
        plain = resolve_stateful(state_dict)
        flat, mapping = flatten_state_dict(plain)
        chosen: dict[str, Any] = {}
        staged = live = 0
        for fqn, value in flat.items():
            if not isinstance(value, torch.Tensor):
                continue
            n = local_tensor(value).numel() * value.element_size()
            if staged + n <= self.budget:
                chosen[fqn] = value
                staged += n
            else:
                live += n
        copies = self._copy(chosen)
        out = {fqn: copies[fqn] if fqn in copies
               else value if isinstance(value, torch.Tensor) else copy.deepcopy(value)
               for fqn, value in flat.items()}
        log.debug("staged %d bytes of tensors in host memory; %d bytes written live",
                  staged, live)
        return StagedState(unflatten_state_dict(out, mapping),
                           frozenset(local_tensor(t).untyped_storage().data_ptr()
                                     for t in copies.values()), staged, live)

    def _copy(self, chosen: dict[str, Any]) -> dict[str, Any]:
        """Host copies of ``chosen``, into the buffers of the last save where the
        layout is the same (pinned where a tensor comes from a GPU)."""
        if not chosen:
            return {}
        layout = {fqn: _layout_of(t) for fqn, t in chosen.items()}
        gpu = any(local_tensor(t).is_cuda for t in chosen.values())
        if layout != self._layout:
            self._buffers = {}  # the old ones go before the new ones are made
            self._buffers = create_cpu_state_dict(chosen, pin_memory=gpu)
            self._layout = layout
            self.allocations += 1
            self.pinned_bytes = sum(local_tensor(t).numel() * t.element_size()
                                    for t in chosen.values()) if gpu else 0
        copy_state_dict(chosen, self._buffers, non_blocking=gpu)
        if gpu:
            torch.cuda.synchronize()
        return dict(self._buffers)

    def close(self) -> None:
        """Free the kept buffers."""
        self._buffers, self._layout = {}, {}
        self.pinned_bytes = 0


def _layout_of(t: torch.Tensor) -> tuple[Any, ...]:
    local = local_tensor(t)
    return (type(t), tuple(t.shape), tuple(local.shape), tuple(local.stride()), t.dtype,
            getattr(t, "placements", None))
