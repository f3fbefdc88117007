"""``cloudckpt doctor`` for verl: read a verl launch (``python3 -m
verl.trainer.main_ppo ...``, ``torchrun ... -m verl.trainer.sft_trainer ...``, or a
config file) and say where each path verl derives lands, with and without ``cloudckpt
run``, before anything starts.

The config is composed as verl's ``@hydra.main`` composes it: verl's packaged config
directory (found without importing verl), or ``--config-path`` (absolute, or relative
to verl's trainer module, as hydra takes it), ``--config-name``, ``--config-dir`` and
the command's overrides. Hydra and OmegaConf only: no torch, no verl, nothing written.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cloudckpt.core.launchplan import LaunchPlan, PathUse, unlaunched
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.verl.paths import PPO_LOCAL, problem
from cloudckpt.integrations.verl.resume import run_root
from cloudckpt.storage import is_remote
from cloudckpt.util import hydracompose

__all__ = ["ENTRIES", "compose", "plan", "read_command"]

#: verl's entry modules: (its hydra config name, what it is).
ENTRIES = {
    "verl.trainer.main_ppo": ("ppo_trainer", "the PPO trainer"),
    "verl.trainer.sft_trainer": ("sft_trainer_engine", "the SFT trainer"),
    "verl.trainer.sft_trainer_ray": ("sft_trainer_engine", "the Ray SFT trainer"),
}
_FLAGS = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name",
          "--config-dir": "dir", "-cd": "dir"}


def verl_dir() -> Path | None:
    """Where verl is installed (its package directory), found without importing it."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _entry(command: Sequence[str]) -> tuple[str, int] | None:
    """verl's entry module the command runs, and where its own arguments start."""
    for i, word in enumerate(command):
        if word == "-m" and i + 1 < len(command) and command[i + 1] in ENTRIES:
            return command[i + 1], i + 2
        if word.endswith(".py"):
            module = ".".join(Path(word).with_suffix("").parts[-3:])
            if module in ENTRIES:
                return module, i + 1
    return None


def read_command(command: Sequence[str]) -> dict[str, Any] | None:
    """The entry and hydra arguments of a verl launch, or None where it is not one. A
    lone YAML file is read as ``--config-path`` its directory, ``--config-name`` its
    name, with verl's packaged configs on the search path (for its ``defaults``)."""
    if len(command) == 1 and command[0].endswith((".yaml", ".yml")) and os.path.isfile(command[0]):
        path = Path(command[0]).resolve()
        text = path.read_text()
        if "actor_rollout_ref" in text or "ppo_trainer" in text:
            entry = "verl.trainer.main_ppo"
        elif "sft_trainer_engine" in text:
            entry = "verl.trainer.sft_trainer"
        else:
            return None
        return {"entry": entry, "path": str(path.parent), "name": path.stem, "dirs": [],
                "overrides": [], "packaged_on_path": True,
                "found_by": f"the config file {command[0]} (its defaults name verl's)"}
    found = _entry(command)
    if found is None:
        return None
    entry, start = found
    args: dict[str, Any] = {"entry": entry, "path": None, "name": None, "dirs": [],
                            "overrides": [], "packaged_on_path": False,
                            "found_by": f"the command line: -m {entry}"}
    words = list(command[start:])
    while words:
        word = words.pop(0)
        flag, eq, value = word.partition("=")
        if flag in _FLAGS:
            if not eq:
                if not words:
                    raise ConfigError(f"{flag} has no value in {shlex.join(command)!r}")
                value = words.pop(0)
            kind = _FLAGS[flag]
            if kind == "dir":
                args["dirs"].append(value)
            else:
                args[kind] = value
        elif not word.startswith("-"):
            args["overrides"].append(word)
    return args


def compose(args: dict[str, Any]) -> Any:
    """The run's config, composed as verl's ``@hydra.main`` does (``hydra`` included)."""
    home = verl_dir()
    if home is None:
        raise ConfigError("verl is not installed here, so its config cannot be composed: "
                          "run `cloudckpt doctor` where the job runs (`pip install verl`)")
    packaged = home / "trainer" / "config"
    config_dir = packaged
    if args["path"]:
        config_dir = Path(args["path"]) if os.path.isabs(args["path"]) \
            else (home / "trainer" / args["path"]).resolve()
    name = args["name"] or ENTRIES[args["entry"]][0]
    search = [f"file://{d}" for d in args["dirs"]]
    if args["packaged_on_path"]:
        search.append(f"file://{packaged}")
    overrides = list(args["overrides"])
    if search:
        overrides.append(f"hydra.searchpath=[{','.join(search)}]")
    return hydracompose.compose(config_dir, name, overrides, needed_by="reading a verl launch",
                                version_base=None, return_hydra_config=True)


def _select(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    except Exception:  # an interpolation only hydra's running job resolves
        return OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)


def _checkpoint_uses(cfg: Any, sft: bool, ray_sft: bool, cwd: str) -> list[PathUse]:
    local = _select(cfg, "trainer.default_local_dir")
    hdfs = _select(cfg, "trainer.default_hdfs_dir")
    refused = None
    try:
        root = run_root(local, hdfs)
    except ConfigError as exc:
        root, refused = None, str(exc)
    if root is not None and ray_sft:
        refused = ("verl's Ray SFT trainer (sft_trainer_ray) cannot save to a bucket with "
                   "cloudckpt: launch the torchrun one, `torchrun ... -m "
                   "verl.trainer.sft_trainer`, or keep trainer.default_local_dir local")
    mode = _select(cfg, "trainer.v1.trainer_mode")
    v1 = not sft and _select(cfg, "trainer.use_v1")
    if root is not None and v1 and mode not in (None, "sync"):
        refused = (f"verl's trainer.v1.trainer_mode: {mode} saves its TransferQueue state as "
                   "local files in each step, which cloudckpt does not commit: set "
                   "trainer.v1.trainer_mode=sync, or keep trainer.default_local_dir local")
    what = "checkpoints (global_step_N) and verl's tracker"
    uses = []
    if is_remote(local):
        uses.append(PathUse("trainer.default_local_dir", str(local), what,
                            f"{str(local).rstrip('/')}/global_step_N, each step committed; "
                            "verl's files staged on local disk during a save only",
                            unlaunched=unlaunched(str(local), cwd), problem=refused))
    else:
        uses.append(PathUse("trainer.default_local_dir", local, what,
                            f"{_local(local, cwd)} (verl's own; a local copy when "
                            "default_hdfs_dir is a bucket)", problem=refused if hdfs else None))
    if hdfs is None:
        uses.append(PathUse("trainer.default_hdfs_dir", None, "a copy of each step",
                            "(unset: no copy)"))
    elif is_remote(hdfs):
        uses.append(PathUse("trainer.default_hdfs_dir", str(hdfs), "a copy of each step",
                            f"{str(hdfs).rstrip('/')}/global_step_N, each step committed",
                            unlaunched=unlaunched(str(hdfs), cwd),
                            problem=refused if not is_remote(local) else None))
    else:
        uses.append(PathUse("trainer.default_hdfs_dir", str(hdfs), "a copy of each step",
                            f"{hdfs} (verl's own hdfs_io copy)"))
    return uses


def _local(value: Any, cwd: str) -> str:
    return os.path.normpath(os.path.join(cwd, str(value)))


def _other_uses(cfg: Any, sft: bool, cwd: str) -> list[PathUse]:
    uses = []
    if not sft:
        for key, holds in PPO_LOCAL.items():
            value = _select(cfg, key)
            if key == "global_profiler.save_path" and not _select(cfg, "global_profiler.tool"):
                continue  # no profiler: nothing is written there
            if value is None:
                uses.append(PathUse(key, None, holds, "(unset: not written)"))
            elif is_remote(value):
                uses.append(PathUse(key, str(value), holds, "refused at the trainer's start",
                                    unlaunched=unlaunched(str(value), cwd),
                                    problem=problem(key, str(value), holds, cwd)))
            else:
                uses.append(PathUse(key, str(value), holds, _local(value, cwd)))
    loggers = _select(cfg, "trainer.logger") or []
    project = _select(cfg, "trainer.project_name")
    experiment = _select(cfg, "trainer.experiment_name")
    if "tensorboard" in loggers:
        where = os.environ.get("TENSORBOARD_DIR") or f"tensorboard_log/{project}/{experiment}"
        uses.append(PathUse("trainer.logger: tensorboard ($TENSORBOARD_DIR)", where,
                            "TensorBoard event files", _local(where, cwd)))
    if "wandb" in loggers:
        where = os.environ.get("WANDB_DIR") or "."
        uses.append(PathUse("trainer.logger: wandb ($WANDB_DIR)", where,
                            "W&B's local run files", os.path.join(_local(where, cwd), "wandb")))
    run_dir = _select(cfg, "hydra.run.dir")
    if run_dir is not None:
        uses.append(PathUse("hydra.run.dir", str(run_dir),
                            "hydra's run directory (.hydra/ config copies, the job's log)",
                            _local(run_dir, cwd)))
    return uses


def plan(command: list[str]) -> LaunchPlan | None:
    """verl's :class:`LaunchPlan` for ``command``, or None where it is no verl launch."""
    args = read_command(command)
    if args is None:
        return None
    cfg = compose(args)
    cwd = os.getcwd()
    entry = args["entry"]
    sft = entry != "verl.trainer.main_ppo"
    uses = _checkpoint_uses(cfg, sft, entry == "verl.trainer.sft_trainer_ray", cwd)
    uses += _other_uses(cfg, sft, cwd)
    notes = []
    if any(is_remote(u.value) for u in uses[:2]):
        notes.append("verl derives nothing else from its checkpoint keys: its logs and "
                     "hydra's run directory stay local, where listed")
    if not sft and _select(cfg, "trainer.use_v1"):
        notes.append("trainer.use_v1: true runs verl's v1 PPOTrainer (bound in its sync "
                     "mode); its module needs TransferQueue, verl's verl-core extra")
    return LaunchPlan("verl", f"{args['found_by']} ({ENTRIES[entry][1]}, config "
                      f"{args['name'] or ENTRIES[entry][0]})", tuple(uses), tuple(notes))
