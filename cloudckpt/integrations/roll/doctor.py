"""ROLL's launch, read before it runs: ``python examples/start_<name>_pipeline.py
--config_path DIR --config_name NAME`` (or a ROLL config file alone), its config composed
with hydra as ROLL's start scripts compose it, and every path ROLL derives from it.

ROLL keeps two kinds of path. ``checkpoint_config.output_dir`` is where checkpoints are
uploaded: a bucket URI there goes to cloudckpt's uploader under ``cloudckpt run``
(:mod:`.bucketkey`). ``output_dir`` (local checkpoint staging, the tensorboard
directory), ``logging_dir``, the profiler directories and ``rollout_dump_dir`` are
written by ROLL with local file calls that cloudckpt does not bind: a bucket URI there
would become a local ``s3:`` directory, so activation refuses it at start-up
(:func:`refuse_unplaceable`) and names the key to set instead.

Reads only: hydra's compose writes nothing, and no torch or Ray is imported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from cloudckpt.core.launchplan import LaunchPlan, PathUse, unlaunched
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.roll.bucketkey import as_written, bucket_scheme
from cloudckpt.runtime.localdirs import local_dir_for
from cloudckpt.util import hydracompose

__all__ = ["plan", "refuse_unplaceable"]

#: ROLL's start scripts: examples/start_rlvr_pipeline.py, start_agentic_pipeline.py, ...
_SCRIPT = re.compile(r"^start_\w*pipeline\.py$")
#: What BaseConfig appends to the directories it stamps (shown, not computed).
_STAMP = "<%Y%m%d-%H%M%S>"
#: Keys a ROLL config file has and other frameworks' do not.
_ROLL_KEYS = ("checkpoint_config", "actor_train")


def plan(command: list[str]) -> LaunchPlan | None:
    """The paths of ROLL launch ``command`` (argv, with or without the interpreter, or a
    config file's path); None when it is not ROLL's."""
    found = _recognise(command)
    if found is None:
        return None
    how, config_dir, config_name, exp_default = found
    cfg = _compose(config_dir, config_name)
    return LaunchPlan("roll", how, tuple(_uses(cfg, exp_default)), tuple(_notes(cfg)))


def refuse_unplaceable(argv: Sequence[str]) -> None:
    """At start-up in ROLL's driver (``argv``: its ``sys.argv``): raise
    :class:`ConfigError` naming each path ROLL would turn into a local directory named
    for a bucket. Anything not recognisably ROLL's launch is left alone."""
    try:
        found = plan(list(argv))
    except ConfigError:
        return  # not composable here (ROLL says why itself); nothing to refuse
    if found is not None and found.problems:
        raise ConfigError("ROLL cannot run this launch on a bucket: " + "; ".join(
            f"{u.key}: {u.problem}" for u in found.problems))


# ------------------------------------------------------------- recognising

def _recognise(command: Sequence[str]) -> tuple[str, Path, str, str] | None:
    words = list(command)
    if len(words) == 1 and words[0].endswith((".yaml", ".yml")):
        path = Path(words[0])
        if not path.is_file() or not _looks_like_roll(path):
            return None
        return (f"the config file {path.name}", path.resolve().parent, path.stem,
                path.stem)
    if words and Path(words[0]).name.startswith("python"):
        words = words[1:]
        while words and words[0].startswith("-") and words[0] not in ("-m", "-c"):
            words = words[2:] if words[0] in ("-X", "-W") else words[1:]
    if not words or not _SCRIPT.match(Path(words[0]).name):
        return None
    script = Path(words[0])
    opts = _options(words[1:])
    config_path = opts.get("config_path", "config")
    config_name = opts.get("config_name")
    if not config_name:
        raise ConfigError(f"{script.name} needs --config_name (ROLL's start scripts compose "
                          "--config_path/--config_name)")
    base = script.resolve().parent
    config_dir = Path(config_path) if os.path.isabs(config_path) else base / config_path
    return (f"the command line: {script.name} --config_name {config_name}",
            config_dir.resolve(), config_name, script.stem)


def _options(words: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    it = iter(words)
    for w in it:
        if w.startswith("--") and "=" in w:
            k, v = w[2:].split("=", 1)
            out[k.replace("-", "_")] = v
        elif w.startswith("--"):
            out[w[2:].replace("-", "_")] = next(it, "")
    return out


def _looks_like_roll(path: Path) -> bool:
    head = path.read_text(errors="replace")
    return any(re.search(rf"(?m)^{k}\s*:", head) for k in _ROLL_KEYS)


def _compose(config_dir: Path, config_name: str) -> dict[str, Any]:
    """ROLL's config as its start script composes it (hydra), resolved."""
    if not (config_dir / f"{config_name}.yaml").is_file():
        raise ConfigError(f"ROLL's config {config_dir / config_name}.yaml does not exist "
                          "(--config_path is relative to the start script's directory)")
    cfg = hydracompose.compose(config_dir, config_name, needed_by="reading a ROLL launch",
                               version_base=None)
    from omegaconf import OmegaConf  # there with hydra

    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # omegaconf's errors: an interpolation that does not resolve
        raise ConfigError(f"ROLL's config {config_name} in {config_dir} does not resolve "
                          f"({exc}): set the key it names") from exc
    return cast(dict[str, Any], data) if isinstance(data, dict) else {}  # a config's keys: str


# ------------------------------------------------------------- the paths

def _uses(cfg: Mapping[str, Any], exp_default: str) -> list[PathUse]:
    exp = str(cfg.get("exp_name") or exp_default)
    output_dir = str(cfg.get("output_dir") or "./output")
    uses = [_checkpoints(cfg)]
    uses.append(_local("output_dir", output_dir, "local checkpoint staging "
                       "(pipeline/ and each worker's checkpoint-N before upload)", output_dir))
    uses.append(_local("logging_dir", cfg.get("logging_dir") or "./output/logs", "logs",
                       os.path.join(str(cfg.get("logging_dir") or "./output/logs"), exp)))
    if (cfg.get("track_with") or "tensorboard") == "tensorboard":
        tracker = (cfg.get("tracker_kwargs") or {}).get("log_dir")
        uses.append(_local("tracker_kwargs.log_dir", tracker, "tensorboard events",
                           os.path.join(str(tracker or output_dir), exp, _STAMP),
                           fallback=output_dir))
    for key, default, holds in (
            ("profiler_output_dir", "./output/profiler", "profiler traces"),
            ("length_profiler_dir", "./output/profiler", "length and reward metrics")):
        value = str(cfg.get(key) or default)
        uses.append(_local(key, value, holds, os.path.join(value, exp, _STAMP)))
    if cfg.get("rollout_dump_dir"):
        value = str(cfg["rollout_dump_dir"])
        uses.append(_local("rollout_dump_dir", value, "rollout dumps", value))
    uses.append(_resume(cfg))
    return uses


def _checkpoints(cfg: Mapping[str, Any]) -> PathUse:
    ckpt = cfg.get("checkpoint_config") or {}
    value = ckpt.get("output_dir")
    kind = ckpt.get("type", "file_system")
    key = "checkpoint_config.output_dir"
    if not value:
        return PathUse(key, None, "checkpoints", "nothing is uploaded (ROLL's checkpoint "
                       "manager has no uploader)")
    value = str(value)
    if bucket_scheme(value) is None:
        stamped = os.path.join(value, _STAMP) if kind == "file_system" else value
        return PathUse(key, value, "checkpoints", _absolute(stamped))
    lands = (f"{as_written(value)}/checkpoint-N (cloudckpt's uploader, committed when "
             "complete; no timestamp appended)")
    if kind == "file_system":
        return PathUse(key, value, "checkpoints", lands,
                       unlaunched=unlaunched(f"{value}/{_STAMP}") + "/checkpoint-N")
    return PathUse(key, value, "checkpoints", lands)


def _local(key: str, value: object, holds: str, lands: str, *,
           fallback: str | None = None) -> PathUse:
    """A path ROLL writes with local file calls: refused when it is a bucket URI."""
    shown = None if value is None else str(value)
    named = shown if shown is not None else fallback
    if named is not None and "://" in named:
        return PathUse(key, shown, holds, "refused", problem=_fix(key, named))
    return PathUse(key, shown, holds, _absolute(lands))


def _fix(key: str, uri: str) -> str:
    try:
        local = local_dir_for(uri)
    except ValueError:
        local = "a local directory"
    why = (f"ROLL writes its {key} with local file calls, which would make a local "
           f"directory named {uri.split('://', 1)[0]}:")
    if key in ("output_dir", "tracker_kwargs.log_dir"):
        return (f"{why}; keep output_dir local (e.g. output_dir: {local}) and put the "
                f"bucket in checkpoint_config.output_dir: {uri}")
    return f"{why}; set {key} to a local directory, e.g. {local}"


def _resume(cfg: Mapping[str, Any]) -> PathUse:
    value = cfg.get("resume_from_checkpoint", False)
    ckpt = cfg.get("checkpoint_config") or {}
    where = ckpt.get("output_dir")
    if value is True:
        if not ckpt.get("type"):
            lands = ("nothing: ROLL's get_latest_ckpt looks nowhere without "
                     "checkpoint_config.type (set type: file_system)")
        elif bucket_scheme(where):
            lands = (f"the newest committed checkpoint-N of {as_written(str(where))}, "
                     "downloaded to a local directory (checkpoint_config.download_dir, "
                     "default: cloudckpt's cache)")
        else:
            lands = f"the newest checkpoint-N under {where}"
    elif isinstance(value, str) and value:
        lands = value if "://" not in value else (
            f"{value} through ROLL's model downloader (MODEL_DOWNLOAD_TYPE): use true, or "
            "`cloudckpt roll fetch` and a local path")
    else:
        lands = "a fresh start"
    return PathUse("resume_from_checkpoint", str(value), "the checkpoint resumed from", lands)


def _notes(cfg: Mapping[str, Any]) -> list[str]:
    ckpt = cfg.get("checkpoint_config") or {}
    notes = []
    if bucket_scheme(ckpt.get("output_dir")) and ckpt.get("expected_uploads") is None:
        notes.append("each checkpoint commits once the pipeline's part and every rank of "
                     "each uploading cluster are in and hold all ROLL's resume reads; one "
                     "that never does is an ERROR at the next save and at exit")
    if cfg.get("resume_from_checkpoint") is True:
        notes.append("resume_from_checkpoint: true makes ROLL upload synchronously "
                      "(async_upload: false)")
    return notes


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.normpath(os.path.join(os.getcwd(), path))

