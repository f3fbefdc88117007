"""The epoch of the data order after a resume, which AReaL's ``cycle_dataloader``
forgets: it counts epochs from 0 on every launch and calls ``sampler.set_epoch`` with
that count, so a run resumed in epoch 1 or later shuffles the rest of that epoch (and
the next ones) as epoch 0, 1, ... again. cloudckpt's ``RecoverHandler.load`` marks the
dataloader it restored with the dumped step's epoch; the cycle activation binds into
AReaL's trainers starts counting there."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

_RESUMED_EPOCH = "_cloudckpt_resumed_epoch"


def mark_resumed(dataloader: Any, epoch: int) -> None:
    """Record on a restored dataloader the epoch its state is in (the dumped step's:
    a state at the end of an epoch yields nothing, then the next epoch starts)."""
    setattr(dataloader, _RESUMED_EPOCH, int(epoch))


def cycle_from_resumed_epoch(own: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """AReaL's ``cycle_dataloader(dataloader, num_cycles=-1)``, counting epochs from the
    one :func:`mark_resumed` recorded; a dataloader not marked cycles as AReaL's own."""

    @functools.wraps(own)
    def cycle_dataloader(dataloader: Any, num_cycles: int = -1) -> Iterator[Any]:
        epoch = getattr(dataloader, _RESUMED_EPOCH, None)
        if epoch is None:
            yield from own(dataloader, num_cycles)
            return
        sampler: Any = getattr(dataloader, "sampler", None)
        cycles = 0
        while True:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            yield from dataloader
            epoch += 1
            cycles += 1
            if 0 < num_cycles <= cycles:
                break

    return cycle_dataloader
