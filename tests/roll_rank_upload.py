"""One "rank" of a concurrent ROLL upload test: stage its own files, wait for the
go signal, upload them into a shared checkpoint-N through the registered uploader."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from cloudckpt.integrations.roll import register


def main(config_json: str, ckpt_id: str, staging: str, go: str) -> None:
    registry: dict = {}
    register(registry)
    cfg = json.loads(config_json)
    uploader = registry[cfg.pop("type")](**cfg)  # as ROLL's CheckpointManager does
    while not Path(go).exists():
        time.sleep(0.01)
    uploader.upload(ckpt_id=ckpt_id, local_state_path=staging)
    uploader.wait()
    print("uploaded", os.getpid(), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
