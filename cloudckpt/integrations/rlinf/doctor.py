"""``cloudckpt doctor`` for RLinf: its usual launch (an entry script of its examples, a
Hydra app: ``python examples/reasoning/main_grpo.py --config-path ... --config-name ...
key=value ...``) or a config file alone, composed with Hydra as RLinf's script would, and
every path it derives, with where each lands.

Reads and composes only: imports Hydra and OmegaConf, never RLinf, and writes nothing.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cloudckpt.core.launchplan import LaunchPlan, PathUse, unlaunched
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.rlinf.layout import checkpoints_root
from cloudckpt.integrations.rlinf.localpaths import (
    LOG_PATH,
    OUTPUT_DIR,
    PROFILING_DIR,
    RESUME_DIR,
    Move,
    moves,
)
from cloudckpt.runtime.localdirs import local_dir_for
from cloudckpt.storage import is_remote
from cloudckpt.util import hydracompose

#: Hydra's options that take a value (``--config-path X`` or ``--config-path=X``).
_VALUED = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name",
           "--config-dir": "dir", "-cd": "dir", "--cfg": None, "-c": None,
           "--package": None, "-p": None, "--info": None, "-i": None,
           "--experimental-rerun": None}
_PYTHON_VALUED = {"-X", "-W", "-c"}


def _script(command: Sequence[str]) -> tuple[Path, list[str]] | None:
    """The Python script ``command`` runs and its arguments (None: not a script)."""
    words = list(command)
    if not words:
        return None
    if Path(words[0]).name.startswith("python"):
        i = 1
        while i < len(words) and words[i].startswith("-"):
            if words[i] in ("-m", "-c"):
                return None  # RLinf's entry points are script files
            i += 2 if words[i] in _PYTHON_VALUED else 1
        words = words[i:]
    if not words or not words[0].endswith(".py"):
        return None
    return Path(words[0]), words[1:]


def _is_rlinf_app(script: Path) -> bool:
    try:
        text = script.read_text(errors="replace")
    except OSError:
        return False
    return "rlinf" in text and "hydra.main" in text


def _has_runner_output_dir(path: Path) -> bool:
    """Whether the YAML file ``path`` is shaped as RLinf's (``runner.output_dir``)."""
    from omegaconf import OmegaConf

    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # unreadable, or not YAML: not a config this reads
        return False
    runner = raw.get("runner") if isinstance(raw, dict) else None
    return isinstance(runner, dict) and "output_dir" in runner


def _hydra_args(args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Hydra's options (path, name, dir) and the overrides of an app's arguments."""
    options: dict[str, str] = {}
    overrides: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        flag, eq, inline = word.partition("=")
        if word.startswith("-") and flag in _VALUED:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if eq else 2
            if name := _VALUED[flag]:
                options[name] = value
            continue
        if not word.startswith("-"):
            overrides.append(word)
        i += 1
    return options, overrides


def _compose(config_dir: Path, name: str | None, overrides: list[str]) -> Any:
    """The config RLinf's script gets: Hydra's own composition (defaults lists, overrides)."""
    return hydracompose.compose(config_dir, name, overrides,
                                needed_by="reading an RLinf launch", version_base="1.1")


def _value(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)


def _local(path: str, cwd: str) -> str:
    return os.path.normpath(os.path.join(cwd, path))


def uses(cfg: Any, cwd: str | None = None) -> tuple[list[PathUse], list[str]]:
    """Every path of RLinf's composed ``cfg`` and where it lands, and notes."""
    cwd = cwd or os.getcwd()
    out, name = str(_value(cfg, OUTPUT_DIR) or ""), _value(cfg, "runner.experiment_name")
    if not out or not name:
        raise ConfigError("the RLinf config sets no runner.output_dir or "
                          "runner.experiment_name: RLinf's runner needs both")
    bucket = is_remote(out)
    ckpts = checkpoints_root(out, str(name))

    def where(uri: str) -> str:  # a local file call's target, under cloudckpt run
        return local_dir_for(uri) if is_remote(uri) else _local(uri, cwd)

    def lost(uri: str) -> str | None:  # ... and without it
        return unlaunched(uri, cwd) if is_remote(uri) else None

    main_log = f"{out.rstrip('/')}/{name}/log/main.log"
    found = [
        PathUse(OUTPUT_DIR, out, "checkpoints: global_step_N/ (actor/, critic/, "
                "data/data.pt), each committed whole", ckpts if bucket else _local(ckpts, cwd),
                unlaunched=lost(ckpts)),
        PathUse(OUTPUT_DIR, out, "the driver's log (RLinf's output_redirector)",
                where(main_log), unlaunched=lost(main_log))]
    moved = {m.key: m for m in moves(cfg)}
    log_path = _value(cfg, LOG_PATH)
    found.append(_local_use(LOG_PATH, log_path, moved, where, lost,
                            "RLinf's loggers (tensorboard/, wandb/, swanlab/ and the saved "
                            "config.yaml), worker_logs/"))
    resume = _value(cfg, RESUME_DIR)
    found.append(_resume_use(resume, bucket, ckpts, log_path, lost))
    if _value(cfg, "cluster.profiling") is not None and \
            _value(cfg, "cluster.profiling.enabled") in (None, True):
        # RLinf's validate_cfg: the key, else {log_path}/{logger.experiment_name}/profiling.
        value = _value(cfg, PROFILING_DIR) or (
            f"{str(log_path).rstrip('/')}/{_value(cfg, 'runner.logger.experiment_name')}"
            "/profiling")
        found.append(_local_use(PROFILING_DIR, value, moved, where, lost,
                                "the profiler's reports"))
    for key, move in moved.items():
        if key not in (LOG_PATH, PROFILING_DIR):
            found.append(_local_use(key, move.value, moved, where, lost,
                                    f"a local path derived from {OUTPUT_DIR}"))
    notes = []
    if bucket:
        notes.append("without `cloudckpt run`, torch's own fsspec writer sends each step's "
                     "DCP shards to the bucket with no manifest (nothing a run resumes "
                     "from), and the rest of the step to the local directory above")
    if resume is None and bucket:
        notes.append("runner.resume_dir is null (RLinf's default): a relaunch over "
                     "committed steps is refused at start-up; set runner.resume_dir=auto to "
                     "resume the newest committed step")
    return found, notes


def _local_use(key: str, value: Any, moved: dict[str, Move], where: Any, lost: Any,
               holds: str) -> PathUse:
    text = None if value is None else str(value)
    move = moved.get(key)
    if move is not None and move.to is None:
        return PathUse(key, text, holds, move.value, unlaunched=lost(move.value),
                       problem=move.problem)
    if text is None:
        return PathUse(key, None, holds, "(unset)")
    return PathUse(key, text, holds, where(text), unlaunched=lost(text))


def _resume_use(resume: Any, bucket: bool, ckpts: str, log_path: Any, lost: Any) -> PathUse:
    holds = "the step a launch resumes from"
    if resume is None:
        return PathUse(RESUME_DIR, None, holds, "nothing: a fresh start")
    text = str(resume)
    if text == "auto":
        if not bucket:
            return PathUse(RESUME_DIR, text, holds, f"the newest global_step_N under "
                           f"{log_path}/checkpoints (RLinf's own scan)")
        # RLinf itself lists {log_path}/checkpoints with os.listdir.
        scanned = f"{str(log_path).rstrip('/')}/checkpoints" if log_path else ckpts
        return PathUse(RESUME_DIR, text, holds, f"the newest committed step under {ckpts}",
                       unlaunched=lost(scanned) or f"{scanned} (a local scan: nothing there "
                       "but RLinf's own local saves)")
    return PathUse(RESUME_DIR, text, holds, text, unlaunched=lost(text))


def plan(command: Sequence[str], cwd: str | None = None) -> LaunchPlan | None:
    """The plan of RLinf's launch ``command``, or of an RLinf config file alone; None
    when it is neither."""
    words = list(command)
    if len(words) == 1 and words[0].endswith((".yaml", ".yml")):
        path = Path(words[0]).resolve()
        if not _has_runner_output_dir(path):  # another framework's config: let it answer
            return None
        cfg = _compose(path.parent, path.stem, [])
        found_by = f"the config file {words[0]} (runner.output_dir)"
    else:
        script = _script(words)
        if script is None or not _is_rlinf_app(script[0]):
            return None
        path, args = script
        options, overrides = _hydra_args(args)
        if "path" not in options:
            raise ConfigError(f"{shlex.join(words)}: RLinf's scripts take their config as "
                              "--config-path DIR --config-name NAME; none is given")
        config_dir = Path(options["path"])
        if not config_dir.is_absolute():  # as Hydra: relative to the script's directory
            config_dir = path.resolve().parent / config_dir
        cfg = _compose(config_dir.resolve(), options.get("name"), overrides)
        found_by = f"the command line: {path} (an RLinf Hydra app)"
    found, notes = uses(cfg, cwd)
    return LaunchPlan("rlinf", found_by, tuple(found), tuple(notes))
