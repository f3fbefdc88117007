"""A script that starts a background save and ends without waiting for it.

Usage: exit_child.py HOW URI, with storage options as JSON in CKPT_OPTIONS.
HOW says how the save starts and how the script ends:

- ``manager-end``, ``manager-sysexit``, ``manager-raise``: a CheckpointManager
  with ``async_save=True`` saves once; the script then ends normally, by
  ``sys.exit(0)``, or by an uncaught exception;
- ``dcp-future``: ``cloudckpt.dcp.async_save``, its future never awaited;
- ``dcp-seen``: the same, its outcome looked at (``exception()``) before the end;
- ``manager-sleep``: the manager saves, prints "saving", then sleeps (for a
  SIGTERM from the parent).

It prints "saving" once the save has started, and never calls close() or wait().
With THROUGH_POOL=1 the ``dcp-*`` saves take every tensor through a pinned pool's
buffers (tests/copy_ops.py).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from copy_ops import writer_options

import cloudckpt.dcp as cdcp
from cloudckpt import CheckpointManager, ManagerOptions, StepInfo


def main() -> None:
    how, uri = sys.argv[1], sys.argv[2]
    options = json.loads(os.environ.get("CKPT_OPTIONS", "{}"))
    torch.manual_seed(0)
    state = {"w": torch.randn(256, 1024), "b": torch.arange(100.0)}
    if how in ("dcp-future", "dcp-seen"):
        fut = cdcp.async_save(state, uri, storage_options=options, step=7,
                              **writer_options())
        if how == "dcp-seen":
            print(f"outcome {type(fut.exception()).__name__}", flush=True)
    else:
        mgr = CheckpointManager(uri, ManagerOptions(async_save=True), storage_options=options)
        mgr.save(StepInfo(global_step=7), state, force=True)
    print("saving", flush=True)
    if how == "manager-sysexit":
        sys.exit(0)
    if how == "manager-raise":
        raise RuntimeError("the training script failed after starting a save")
    if how == "manager-sleep":
        time.sleep(120)


if __name__ == "__main__":
    main()
