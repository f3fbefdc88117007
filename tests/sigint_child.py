"""A sync save that the parent interrupts with SIGINT (Ctrl-C).

Usage: sigint_child.py HOW URI, storage options as JSON in CKPT_OPTIONS; HOW is
``dcp`` (cloudckpt.dcp.save), ``manager`` (a CheckpointManager's sync save) or
``writer`` (a CheckpointWriter's ``with`` block).
Prints "ready" just before the save starts, then one line: "interrupted SECONDS"
when the save raised KeyboardInterrupt (the seconds since the save began),
"saved" when it completed, or "other NAME: MESSAGE" for any other exception.
With CATCH=0 in the environment the KeyboardInterrupt is not caught. With
SWALLOW=1 the save interrupts itself where Python drops the KeyboardInterrupt (in
a finalizer, as a Cython module's first import also does), instead of waiting
for the parent's signal. With THROUGH_POOL=1 (``dcp`` only) every tensor's bytes go
through a pinned pool's buffers (tests/copy_ops.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from copy_ops import writer_options

import cloudckpt.dcp as cdcp
from cloudckpt import CheckpointManager, CheckpointWriter, StepInfo


class _Dropped:
    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs here; Python prints and drops its error
            pass


class SwallowsCtrlC:
    """A stateful object whose ``state_dict()`` gets a Ctrl-C that never comes out."""

    def state_dict(self) -> dict:
        _Dropped()  # collected at once
        return {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


def main() -> None:
    # Python's own Ctrl-C handling, even where this process was started with SIGINT
    # ignored (a background job of a non-interactive shell inherits that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    how, uri = sys.argv[1], sys.argv[2]
    options = json.loads(os.environ.get("CKPT_OPTIONS", "{}"))
    state: dict = {f"t{i}": torch.full((512, 1024), float(i)) for i in range(16)}  # 32 MiB
    swallow = os.environ.get("SWALLOW") == "1"
    if swallow:
        state["swallows"] = SwallowsCtrlC()

    def save() -> None:
        if how == "manager":
            CheckpointManager(uri, storage_options=options).save(StepInfo(), state, force=True)
        elif how == "writer":
            with CheckpointWriter(uri, storage_options=options) as ckpt:
                ckpt.put("model.bin", state["t1"].numpy().tobytes())
                if swallow:
                    state["swallows"].state_dict()
        else:
            cdcp.save(state, uri, storage_options=options, **writer_options())

    start = time.monotonic()
    if os.environ.get("CATCH") == "0":
        print("ready", flush=True)
        save()
        print("saved", flush=True)
        return
    try:  # "ready" inside: a signal right after it lands in the save, not before the try
        print("ready", flush=True)
        save()
    except KeyboardInterrupt:
        print(f"interrupted {time.monotonic() - start:.3f}", flush=True)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        print(f"other {type(exc).__name__}: {exc}", flush=True)
    else:
        print("saved", flush=True)


if __name__ == "__main__":
    main()
