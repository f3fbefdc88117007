"""``cloudckpt doctor -- COMMAND`` (and ``cloudckpt run --check``): what a framework
launch will do with each path its config names, said before any training starts.

Each framework that declares a :attr:`~cloudckpt.core.plugins.Framework.doctor` is
asked in turn (or only the one ``--framework`` names); the first that recognises the
command answers with a :class:`~cloudckpt.core.launchplan.LaunchPlan`. This module
names no framework.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
from collections.abc import Sequence

from cloudckpt.core.launchplan import LaunchPlan
from cloudckpt.core.plugins import Framework, frameworks
from cloudckpt.errors import ConfigError
from cloudckpt.util.lazy import load_target

log = logging.getLogger(__name__)

__all__ = ["add_doctor", "cmd_doctor", "plan_launch", "report"]


def add_doctor(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--framework", metavar="NAME", default=None,
                    help="read the command as this framework's (default: the first "
                    "framework that recognises it)")
    sp.add_argument("--json", action="store_true", help="print the plan as JSON")
    sp.add_argument("launch", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                    help="the launch command, with or without `cloudckpt run --` in front, "
                    "or a framework config file")


def _doctors(name: str | None) -> list[Framework]:
    known = [f for f in frameworks() if f.doctor]
    if name is None:
        return known
    chosen = [f for f in known if f.name == name]
    if not chosen:
        raise ConfigError(f"no framework named {name} can read a launch (known: "
                          f"{', '.join(f.name for f in known) or 'none'})")
    return chosen


def split_launcher(command: Sequence[str]) -> tuple[list[str], bool]:
    """``command`` without a leading ``cloudckpt run [options] --`` (or ``python -m
    cloudckpt run ...``), and whether it had one: is launched under activation."""
    words = list(command)
    if words[:1] == ["--"]:
        words = words[1:]
    for i in range(min(len(words), 3)):
        if words[i].rsplit("/", 1)[-1] == "cloudckpt" and words[i + 1:i + 2] == ["run"]:
            rest = words[i + 2:]
        elif words[i:i + 3] == ["-m", "cloudckpt", "run"]:
            rest = words[i + 3:]
        else:
            continue
        return (rest[rest.index("--") + 1:] if "--" in rest else rest), True
    return words, False


def plan_launch(command: Sequence[str], framework: str | None = None) -> LaunchPlan:
    """The plan of the first framework (or ``framework``) that recognises ``command``."""
    if not command:
        raise ConfigError("no command to read; give the launch command after --, e.g. "
                          "cloudckpt doctor -- torchrun --nproc-per-node 8 train.py "
                          "--config config.yaml")
    for fw in _doctors(framework):
        plan = load_target(fw.doctor or "")(list(command))
        if plan is not None:
            return plan
    raise ConfigError(f"no framework recognises {shlex.join(command)!r} (asked: "
                      f"{', '.join(f.name for f in _doctors(framework)) or 'none'}); name "
                      "one with --framework NAME, or give its config file")


def report(plan: LaunchPlan, command: Sequence[str], launched: bool) -> list[str]:
    """The plan as lines a user reads, and what to fix."""
    lines = [f"{plan.framework}, recognised by {plan.found_by}"]
    for use in plan.uses:
        lines.append(f"  {use.key} = {use.value if use.value is not None else '(unset)'}")
        lines.append(f"      {use.holds}: {use.lands}")
        if use.unlaunched and not launched:
            lines.append(f"      without `cloudckpt run`: {use.unlaunched}")
        if use.problem:
            lines.append(f"      REFUSED: {use.problem}")
    lines.extend(f"  note: {n}" for n in plan.notes)
    return lines


def check(command: Sequence[str], framework: str | None, *, as_json: bool,
          launched: bool | None = None) -> int:
    """Print the plan of ``command``; raise :class:`ConfigError` when the launch would
    be refused, or would miss the bucket for want of ``cloudckpt run``."""
    words, under_run = split_launcher(command)
    launched = under_run if launched is None else launched
    plan = plan_launch(words, framework)
    if as_json:
        print(json.dumps({**dataclasses.asdict(plan), "launched": launched}, indent=2))
    else:
        print("\n".join(report(plan, words, launched)))
    if plan.problems:
        raise ConfigError("; ".join(f"{u.key}: {u.problem}" for u in plan.problems))
    if plan.forgotten and not launched:
        where = ", ".join(f"{u.key} -> {u.unlaunched}" for u in plan.forgotten)
        raise ConfigError(f"launched like this, {plan.framework} writes to local "
                          f"directories named for the URIs ({where}), and nothing written "
                          "there reaches the bucket: launch it as "
                          f"`cloudckpt run -- {shlex.join(words)}`")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    return check(args.launch, args.framework, as_json=args.json)
