"""When AReaL saves: its epoch/step/time frequency control, and what the Saver and the
RecoverHandler share around it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.integrations.areal.config import steps_per_epoch
from cloudckpt.integrations.areal.layout import save_root
from cloudckpt.training.schedule import SaveSchedule


class FreqCtl:
    """AReaL's epoch/step/time frequency controller on :class:`SaveSchedule`.

    The decision is ``SaveSchedule``'s (OR of the three counters, each restarting
    only when it fires, time MAX-all-reduced); :meth:`state_dict` renders it in
    AReaL's ``EpochStepTimeFreqCtl`` JSON shape (``{"epoch", "step", "time"}``, each
    a ``FrequencyControl`` state) so ``saver_info.json`` and ``checkpoint_info.json``
    keep their schema, and :meth:`load_state_dict` reads that shape back.
    """

    def __init__(self, freq_epochs: int | None, freq_steps: int | None,
                 freq_secs: float | None, group: Any = None) -> None:
        self.schedule = SaveSchedule(every_steps=freq_steps, every_epochs=freq_epochs,
                                     every_seconds=freq_secs, group=group)
        self.freq = (freq_epochs, freq_steps, freq_secs)
        self.start_time = time.time()
        self.total_epochs = 0
        self.total_steps = 0
        self.calls = 0
        self.time_fired_at_call = 0
        self.last_interval_seconds: float | None = None

    def check(self, *, epochs: int, steps: int = 1) -> bool:
        """Advance every counter; True when any fires (call once per training step)."""
        before = self.schedule.state_dict()["elapsed"]
        fired = self.schedule.check(steps=steps, epochs=epochs)
        after = self.schedule.state_dict()["elapsed"]
        self.total_epochs += epochs
        self.total_steps += steps
        self.calls += 1
        self.last_interval_seconds = before
        if self.freq[2] and after < before:
            self.time_fired_at_call = self.calls
        return fired

    def state_dict(self) -> dict[str, Any]:
        now = time.time()
        sched = self.schedule.state_dict()
        elapsed = float(sched["elapsed"])

        def ctl(freq_seconds: Any, freq_steps: Any, steps: int, last_steps: int,
                last_time: float, interval_seconds: Any) -> dict[str, Any]:
            return {"frequence_seconds": freq_seconds, "frequency_steps": freq_steps,
                    "start_time": self.start_time, "steps": steps, "last_time": last_time,
                    "last_steps": last_steps, "interval_steps": steps - last_steps,
                    "interval_seconds": interval_seconds, "initial_value": False}

        last = now - elapsed
        return {
            "epoch": ctl(None, self.freq[0], self.total_epochs,
                         self.total_epochs - int(sched["epochs"]), last, elapsed),
            "step": ctl(None, self.freq[1], self.total_steps,
                        self.total_steps - int(sched["steps"]), last, elapsed),
            "time": ctl(self.freq[2], None, self.calls, self.time_fired_at_call, last,
                        elapsed),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            ep, st, tm = state["epoch"], state["step"], state["time"]
            self.total_epochs, self.total_steps = int(ep["steps"]), int(st["steps"])
            self.calls, self.time_fired_at_call = int(tm["steps"]), int(tm["last_steps"])
            self.start_time = float(tm["start_time"])
            elapsed = tm.get("interval_seconds")
            self.schedule.load_state_dict({
                "epochs": self.total_epochs - int(ep["last_steps"]),
                "steps": self.total_steps - int(st["last_steps"]),
                # The time since the last save excludes the downtime, as SaveSchedule does.
                "elapsed": float(elapsed) if elapsed is not None else 0.0})
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not an AReaL frequency-control state ({exc!r}): "
                              f"{dict(state)!r}"[:500]) from None


class Periodic:
    """What Saver and RecoverHandler share: their config (AReaL's dataclass or this
    package's), the ``FinetuneSpec``, where they write, and the frequency control that
    decides when."""

    def __init__(self, config: Any, ft_spec: Any,
                 storage_options: Mapping[str, Any] | None, process_group: Any) -> None:
        self.config = config
        self.ft_spec = ft_spec
        self.steps_per_epoch = steps_per_epoch(ft_spec)
        self.storage_options = dict(storage_options or {})
        self.group = process_group
        self.freq_ctl = FreqCtl(config.freq_epochs, config.freq_steps, config.freq_secs,
                                process_group)

    @property
    def root(self) -> str:
        """The trial's directory: ``{fileroot}/checkpoints/{user}/{experiment}/{trial}``."""
        return save_root(self.config)

    def epoch_ends(self, epoch_step: int) -> int:
        """1 when ``epoch_step`` is the last of its epoch (AReaL's epoch count)."""
        return int(epoch_step == self.steps_per_epoch - 1)
