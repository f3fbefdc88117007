"""Recover slots that hold training state: :class:`RecoverSlot` saves a training
checkpoint as a slot's new generation and loads the current one.

The slot's commit protocol (pointer, generations, compare-and-swap) is
:class:`cloudckpt.core.slots.Slot`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cloudckpt.core.slots import Slot

if TYPE_CHECKING:  # training needs torch: imported by save and load, not to read a slot
    from cloudckpt.runtime.state import StepInfo
    from cloudckpt.training import snapshot as training


class RecoverSlot(Slot):
    """A fixed URI that every save overwrites, keeping the last good copy until
    the new one is committed (one generation at rest, at most two during a save).

    Call :meth:`save`/:meth:`load` on every rank of a distributed job; rank 0
    of ``process_group`` swaps the pointer.
    """

    def save(
        self,
        state_dict: Mapping[str, Any],
        *,
        step_info: StepInfo | None = None,
        extra: Mapping[str, Any] | None = None,
        per_rank: Mapping[str, Any] | None = None,
        rng: bool = True,
        step: int | None = None,
    ) -> str:
        """Save a new generation and make it current; return its name.

        ``state_dict`` goes through DCP (model, optimizer); ``extra`` holds
        shared state (stateful objects or plain data), ``per_rank`` each rank's
        own (e.g. its dataloader); RNG state is saved unless ``rng=False``.
        """
        from cloudckpt.training import snapshot as training

        if step is None and step_info is not None:
            step = step_info.global_step
        captured = training.capture_together(app_state=state_dict, step_info=step_info,
                                              shared=extra, per_rank=per_rank, rng=rng,
                                              group=self.group)
        return self.commit(
            lambda gen: training.write(gen, state_dict, captured,
                                       training.WriteOptions(step=step,
                                                             metadata={"slot": self.uri}),
                                       group=self.group),
            step=step, step_info=step_info)

    def load(
        self,
        state_dict: Mapping[str, Any],
        *,
        extra: Mapping[str, Any] | None = None,
        per_rank: Mapping[str, Any] | None = None,
        rng: bool = True,
    ) -> training.Restored:
        """Load the current generation into ``state_dict`` (in place) and the
        stateful objects given; return the step info and shared values."""
        from cloudckpt.training import snapshot as training

        return training.read(self._current_store(), state_dict, training.ReadOptions(rng=rng),
                             shared=extra, per_rank=per_rank, group=self.group)
