"""One "rank" of a concurrent ROLL upload test: stage its own files, wait for the
go signal, upload them into a shared checkpoint-N through the registered uploader.

Exits 0 once its checkpoint is committed, or with the error's exit code (printed on
stderr) when ``wait`` reports it never got all its parts."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from cloudckpt.errors import CloudCkptError, exit_code
from cloudckpt.integrations.roll import register


def main(config_json: str, ckpt_id: str, staging: str, go: str) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    registry: dict = {}
    register(registry)
    cfg = json.loads(config_json)
    uploader = registry[cfg.pop("type")](**cfg)  # as ROLL's CheckpointManager does
    while not Path(go).exists():
        time.sleep(0.01)
    uploader.upload(ckpt_id=ckpt_id, local_state_path=staging)
    print("uploaded", os.getpid(), flush=True)
    try:
        uploader.wait()
    except CloudCkptError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exit_code(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
