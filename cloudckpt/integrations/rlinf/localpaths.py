"""Where RLinf's local files go when its config names a bucket.

RLinf derives local directories from ``runner.output_dir``: ``runner.logger.log_path``
(by default ``${runner.output_dir}/${runner.experiment_name}``: its loggers' TensorBoard,
wandb and swanlab directories and the saved ``config.yaml``, the per-worker logs, the
profiler's reports) and any key of the user's config that interpolates it (e.g. the
Megatron converter's ``save_path``). It writes them with local file calls, so a bucket
``output_dir`` would make them local directories named ``s3:``. Under activation each
such key that *derives* a bucket URI (an interpolation) is set to the local directory
named for that URI (:func:`~cloudckpt.runtime.localdirs.local_dir_for`); one the user
*spelled* as a bucket URI is refused with the key to set. Checkpoints stay in the
bucket: RLinf builds their paths from ``runner.output_dir`` in code, which stays as is.

Plain OmegaConf: no RLinf import, so :mod:`.doctor` says the same before a launch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.runtime.localdirs import local_dir_for
from cloudckpt.storage import is_remote

log = logging.getLogger(__name__)

OUTPUT_DIR = "runner.output_dir"
RESUME_DIR = "runner.resume_dir"
LOG_PATH = "runner.logger.log_path"
PROFILING_DIR = "cluster.profiling.output_dir"
#: Keys RLinf reads as local directories even when no interpolation derives them.
LOCAL_KEYS = (LOG_PATH, PROFILING_DIR)
#: Keys cloudckpt reads as bucket URIs (checkpoints, the step resumed from).
BUCKET_KEYS = (OUTPUT_DIR, RESUME_DIR)
#: What an interpolation names when it derives a path from these.
_SOURCES = ("runner.output_dir", "runner.logger.log_path")


@dataclass(frozen=True)
class Move:
    """One local path key whose value is a bucket URI."""

    key: str
    #: Its value, resolved.
    value: str
    #: The local directory it becomes; None when it is refused (spelled as a URI).
    to: str | None

    @property
    def problem(self) -> str | None:
        if self.to is not None:
            return None
        return (f"{self.key} is the bucket URI {self.value}, where RLinf writes with local "
                f"file calls (a local directory named {self.value.split('/')[0]}); set "
                f"{self.key} to a local directory, or leave it to RLinf's default, "
                "derived from runner.output_dir (under cloudckpt run, a local directory "
                "named for the bucket)")


def _strings(node: Any, prefix: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, f"{prefix}{key}." if isinstance(key, str) else "")
    elif isinstance(node, str) and prefix:
        yield prefix[:-1], node


def _derived(cfg: Any) -> list[str]:
    """The keys whose raw value interpolates ``runner.output_dir`` or the log path."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=False)
    return [key for key, text in _strings(raw, "")
            if "${" in text and any(src in text for src in _SOURCES)]


def _get(cfg: Any, key: str) -> tuple[object, bool]:
    """``key``'s resolved value (None when unset or unresolvable) and whether it is an
    interpolation."""
    from omegaconf import OmegaConf

    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if parent is None or not OmegaConf.is_dict(parent) or leaf not in parent:
        return None, False
    value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
    return value, OmegaConf.is_interpolation(parent, leaf)


def moves(cfg: Any) -> list[Move]:
    """Every local path key of ``cfg`` whose value is a bucket URI, in the order they
    are set (``runner.logger.log_path`` first, as later keys may derive from it)."""
    found: list[Move] = []
    for key in dict.fromkeys([*LOCAL_KEYS, *_derived(cfg)]):
        if key in BUCKET_KEYS:
            continue
        value, derived = _get(cfg, key)
        if not is_remote(value):
            continue
        assert isinstance(value, str)
        found.append(Move(key, value, local_dir_for(value) if derived else None))
    return found


def check(cfg: Any) -> list[Move]:
    """:func:`moves`, after refusing any key spelled as a bucket URI."""
    found = moves(cfg)
    refused = [m.problem for m in found if m.problem]
    if refused:
        raise ConfigError("; ".join(refused))
    return found


def localise(cfg: Any) -> list[Move]:
    """Set each derived bucket path of ``cfg`` (RLinf's config, before RLinf reads it)
    to its local directory; refuse one spelled as a bucket URI. Returns what moved."""
    from omegaconf import OmegaConf, open_dict

    done: list[Move] = []
    while pending := check(cfg):  # one at a time: a later key may derive from it
        move = pending[0]
        with open_dict(cfg):
            OmegaConf.update(cfg, move.key, move.to, merge=False)
        log.info("cloudckpt: RLinf's %s (%s) is local: %s", move.key, move.value, move.to)
        done.append(move)
    return done
