"""One process of tests/test_staging_leftovers.py: an AReaL export staged under
``$CLOUDCKPT_STAGING``. ``hold`` blocks inside the engine's save, after the engine
wrote the export into the staging directory and before the upload, until it is killed;
``finish`` exports the same step to the end.

    python tests/staging_child.py {hold,finish} FILEROOT STORAGE_OPTIONS_JSON
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from cloudckpt.integrations import areal
from cloudckpt.integrations.areal.engines import ModuleEngine


class HoldingEngine:
    """AReaL's engine interface: the module's own save, then a wait to be killed."""

    def __init__(self, inner: ModuleEngine) -> None:
        self.inner = inner

    def save(self, meta: Any) -> None:
        self.inner.save(meta)
        print(f"staged {meta.path}", flush=True)
        time.sleep(600)

    def load(self, meta: Any) -> None:
        self.inner.load(meta)


def main(mode: str, fileroot: str, options: str) -> int:
    cfg = areal.SaverConfig(experiment_name="exp", trial_name="staged", fileroot=fileroot,
                            freq_steps=1, user="alice")
    torch.manual_seed(0)
    engine = ModuleEngine(areal.Engine(torch.nn.Linear(64, 64),
                                       hf_config={"model_type": "linear-test"}))
    saver = areal.Saver(cfg, 4, storage_options=json.loads(options))
    saver.save(HoldingEngine(engine) if mode == "hold" else engine, 0, 0, 0)
    print(f"exported {saver.last_export}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
