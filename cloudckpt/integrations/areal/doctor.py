"""``cloudckpt doctor`` for AReaL: reads a launch as AReaL would and says where each path
of its config lands.

AReaL's launches all read ``--config FILE`` and hydra overrides after a script:
``python train.py --config c.yaml k=v``, ``torchrun ... train.py --config ...`` (its SPMD
mode), ``python -m areal.infra.launcher.local train.py --config ...`` (and the ``ray`` and
``slurm`` launchers). The config is composed as AReaL's ``parse_cli_args`` composes it
(hydra, the file's directory as the config path, the overrides), without importing
AReaL itself (which loads torch), and placed by :mod:`.placement`, the code activation
runs. Nothing is written.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Sequence
from typing import Any, cast

from cloudckpt.core.launchplan import LaunchPlan, PathUse, unlaunched
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.areal import placement
from cloudckpt.integrations.areal.yaml_loader import pyyaml
from cloudckpt.storage import is_remote
from cloudckpt.util import hydracompose

_YAML = (".yaml", ".yml")


def plan(command: list[str]) -> LaunchPlan | None:
    """The launch plan of an AReaL command (or config file), or None if it is not one."""
    found = recognise(command)
    if found is None:
        return None
    config_file, overrides, found_by = found
    cfg = compose(config_file, overrides)
    uses = tuple(_use(p, cfg) for p in placement.plan(cfg))
    return LaunchPlan("areal", found_by, uses, notes=tuple(_notes(cfg, uses)))


def recognise(command: Sequence[str]) -> tuple[str, list[str], str] | None:
    """``(config file, overrides, how it was recognised)`` of an AReaL launch."""
    words = list(command)
    if len(words) == 1 and words[0].endswith(_YAML):
        return (words[0], [], "its config file") if _looks_areal(words[0]) else None
    module = next((words[i + 1] for i, w in enumerate(words[:-1])
                   if w == "-m" and words[i + 1].startswith("areal.")), None)
    start = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
    if start is None and module is None:
        return None
    rest = words[(start if start is not None else words.index(cast(str, module))) + 1:]
    config, overrides = None, []
    i = 0
    while i < len(rest):
        word = rest[i]
        if word == "--config" and i + 1 < len(rest):
            config, i = rest[i + 1], i + 2
            continue
        if word.startswith("--config="):
            config = word.partition("=")[2]
        elif "=" in word and not word.startswith("-"):
            overrides.append(word)
        i += 1
    if config is None or not (module or _looks_areal(config)):
        return None
    how = f"-m {module}" if module else f"{os.path.basename(words[cast(int, start)])} --config"
    return config, overrides, f"the command line: {how} {config} (AReaL's config form)"


def _looks_areal(path: str) -> bool:
    """Whether the YAML at ``path`` is shaped like an AReaL experiment config."""
    yaml = pyyaml(f"telling whether {path} is an AReaL config")
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("cluster"), dict) \
        or isinstance(doc, dict) and all(isinstance(doc.get(s), dict)
                                         for s in ("saver", "recover"))


def compose(config_file: str, overrides: list[str]) -> Any:
    """The config as AReaL's ``parse_cli_args`` composes it."""
    path = os.path.abspath(config_file)
    if not os.path.isfile(path):
        raise ConfigError(f"AReaL's config file {config_file} does not exist")
    return hydracompose.compose(os.path.dirname(path), os.path.basename(path).rsplit(".", 1)[0],
                                overrides, needed_by=f"reading AReaL's config {config_file}",
                                job_name="app", version_base=None)


def _select(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    except OmegaConfBaseException:
        return None


def _suffix(cfg: Any, key: str) -> str:
    """What AReaL appends below a section's ``fileroot``."""
    section = key.rpartition(".")[0]
    kind = {"saver": "checkpoints", "recover": "checkpoints", "stats_logger": "logs",
            "perf_tracer": "logs", "rollout": "logs"}.get(section)
    if kind is None:
        return ""
    parts = [_select(cfg, f"{section}.experiment_name"), _select(cfg, f"{section}.trial_name")]
    if not all(isinstance(p, str) for p in parts):
        return f"/{kind}/..."
    return "/".join(["", kind, getpass.getuser(), *parts])


def _use(p: placement.Placed, cfg: Any) -> PathUse:
    suffix = _suffix(cfg, p.key)
    lands = f"{str(p.lands).rstrip('/')}{suffix}" if p.lands else "(unset)"
    if p.moved:
        lands += f" (local: named for {p.value})"
    return PathUse(key=p.key, value=p.value,
                   holds=placement.HOLDS.get(p.key, "files AReaL derives from it"),
                   lands=lands,
                   unlaunched=unlaunched(f"{p.value.rstrip('/')}{suffix}")
                   if is_remote(p.value) else None,
                   problem=p.problem)


def _notes(cfg: Any, uses: tuple[PathUse, ...]) -> list[str]:
    notes = []
    mode = _select(cfg, "recover.mode")
    if isinstance(mode, bool):
        notes.append(f"recover.mode is a bare YAML {'on' if mode else 'off'} (read as "
                     f"{str(mode).lower()}): under cloudckpt run, with recover.fileroot in a "
                     f"bucket, it means \"{'on' if mode else 'off'}\"; AReaL alone refuses it "
                     f"(write auto, or quote it)")
        mode = "on" if mode else "off"
    if mode in (None, "disabled", "off"):
        notes.append("recover.mode is " + (f"{mode}" if mode else "unset (AReaL's default: "
                     "disabled)") + ": no recover dump is taken, a relaunch starts "
                     "over, and a launch over a trial that holds a dump is refused; set "
                     "recover.mode: on to resume from the last dump")
    elif all(_select(cfg, f"recover.freq_{u}") is None for u in ("epochs", "steps", "secs")):
        notes.append("recover.freq_epochs, freq_steps and freq_secs are all null: no "
                     "recover dump is ever taken, so a relaunch starts over")
    if any(is_remote(u.value) for u in uses if u.key == "cluster.fileroot"):
        notes.append("AReaL's local files go below the working directory's "
                     "cloudckpt-local/ (CLOUDCKPT_LOCAL_DIR moves it); a job on several "
                     "nodes needs it on a shared file system, or set "
                     "cluster.name_resolve.nfs_record_root to a shared directory")
    return notes
