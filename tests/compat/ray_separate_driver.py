"""A Ray driver connecting to a cluster started on its own, run by
test_ray_separate_cluster.py as ``[cloudckpt run --] python ray_separate_driver.py
ADDRESS OUT_JSON``: it passes a runtime_env of its own (a variable and a setup hook, as
verl's main_ppo passes one), then a task and an actor each import verl's checkpoint
manager module and report what is bound in their process. OUT_JSON gets the reports."""

from __future__ import annotations

import json
import os
import sys

import ray

PROBED = "verl.utils.checkpoint.fsdp_checkpoint_manager"


def users_hook() -> None:
    """The user's own setup hook: it must still run, after activation."""
    os.environ["USERS_HOOK_SAW"] = os.environ.get("CLOUDCKPT_INTEGRATIONS", "unset")


def probe() -> dict:
    import importlib

    module = importlib.import_module(PROBED)
    return {"pid": os.getpid(), "bound": sorted(module.__dict__.get("__cloudckpt_bound__", ())),
            "bound_method": hasattr(module.FSDPCheckpointManager.save_checkpoint, "__wrapped__"),
            "env": {k: os.environ.get(k) for k in (
                "CLOUDCKPT_INTEGRATIONS", "CLOUDCKPT_ATTEMPT_STARTED", "CLOUDCKPT_RUN_ID",
                "USERS_VAR", "USERS_HOOK_SAW")},
            "hook_dir_on_path": any("activation" in p and p.endswith("site")
                                    for p in os.environ.get("PYTHONPATH", "").split(":"))}


@ray.remote
def probe_task() -> dict:
    return probe()


@ray.remote
class Prober:
    def report(self) -> dict:
        return probe()


def main() -> None:
    address, out = sys.argv[1], sys.argv[2]
    ray.init(address=address, runtime_env={"env_vars": {"USERS_VAR": "kept"},
                                           "worker_process_setup_hook": users_hook})
    try:
        task = ray.get(probe_task.remote(), timeout=300)
        actor = ray.get(Prober.remote().report.remote(), timeout=300)
        report = {"task": task, "actor": actor,
                  "driver_env": {k: os.environ.get(k) for k in (
                      "CLOUDCKPT_ATTEMPT_STARTED", "CLOUDCKPT_RUN_ID")}}
    finally:
        ray.shutdown()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
