"""What a framework launch will do with each path its config names: the answer of
``cloudckpt doctor`` (and ``cloudckpt run --check``), given by each framework's
:attr:`~cloudckpt.core.plugins.Framework.doctor`, read before any training starts.

A framework's doctor reads the launch command (or a config file) with the
framework's own config machinery where it can, and says for every path key: what it
holds, where it lands under ``cloudckpt run``, where it would land without it (a
bucket URI handed to local file calls becomes a local directory named ``s3:``), and
whether activation will refuse it (and which key to set instead).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["LaunchPlan", "PathUse", "unlaunched"]


@dataclass(frozen=True)
class PathUse:
    """One path a launch uses."""

    #: The config key, as the user spells it (``trainer.default_local_dir``).
    key: str
    #: Its value, resolved (interpolations applied); None where unset.
    value: str | None
    #: What the framework keeps there (``checkpoints``, ``logs``, ``tokenizer copy``).
    holds: str
    #: Where that lands under ``cloudckpt run``: a URI, or a local path.
    lands: str
    #: Where it would land without ``cloudckpt run``, if that differs (the symptom of
    #: the forgotten launcher).
    unlaunched: str | None = None
    #: Set when activation refuses this path at start-up: what is wrong and the key to
    #: set instead.
    problem: str | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """A framework launch, as its doctor reads it."""

    #: The framework's name (its :class:`~cloudckpt.core.plugins.Framework` name).
    framework: str
    #: How it was recognised (``the command line: -m verl.trainer.main_ppo``).
    found_by: str
    #: Every path the launch uses.
    uses: tuple[PathUse, ...]
    #: Anything else worth saying before the run starts, one sentence each.
    notes: tuple[str, ...] = field(default=())

    @property
    def problems(self) -> tuple[PathUse, ...]:
        """The paths activation would refuse."""
        return tuple(u for u in self.uses if u.problem)

    @property
    def forgotten(self) -> tuple[PathUse, ...]:
        """The paths that go somewhere else without ``cloudckpt run``."""
        return tuple(u for u in self.uses if u.unlaunched)


def unlaunched(value: str, cwd: str | None = None) -> str:
    """Where local file calls (``os.makedirs``, ``open``) put ``value``, a bucket URI
    given where a framework expects a local path: ``s3://b/x`` becomes the local
    directory ``<cwd>/s3:/b/x``."""
    return os.path.normpath(os.path.join(cwd or os.getcwd(), value))
