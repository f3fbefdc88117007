"""``cloudckpt run -- COMMAND``: the launch command with the integrations activated in
it and in every Python process it starts (see :mod:`cloudckpt.activation`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys

from cloudckpt import activation
from cloudckpt.cli import doctor
from cloudckpt.errors import ConfigError
from cloudckpt.runtime import attempt

log = logging.getLogger(__name__)


def add_run(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--integration", action="append", metavar="NAME", default=None,
                    help="activate only this integration (repeatable; default: every one, "
                    "each binding when its framework is imported)")
    sp.add_argument("--allow-untested", action="store_true",
                    help="bind into framework versions the integration was not tested with "
                    f"(${activation.ENV_ALLOW_UNTESTED}=1)")
    sp.add_argument("--print-env", choices=("shell", "json"), nargs="?", const="shell",
                    default=None, help="print the variables that activate it, for workers "
                    "started elsewhere (not the command's children, not Ray workers, which "
                    "ray.init carries it to), instead of running anything")
    sp.add_argument("--run-id", metavar="ID", default=None,
                    help="the id of the run this command is an attempt of "
                    f"(${attempt.RUN_ENV}): a relaunch with the same id takes over the saves "
                    "its crashed attempt left claimed at once (SLURM's and torchrun's ids "
                    "are read without it)")
    sp.add_argument("--check", action="store_true",
                    help="run nothing: say what the launch will do with each path its "
                    "framework config names (as `cloudckpt doctor`), exit 2 if it would be "
                    "refused")
    sp.add_argument("launch", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                    help="the usual launch command (torchrun ..., python -m ..., a Ray "
                    "driver script)")


def cmd_run(args: argparse.Namespace) -> int:
    env = activation.environment(args.integration, allow_untested=args.allow_untested)
    if args.print_env == "json":
        print(json.dumps({"env_vars": env}, indent=2))
        return 0
    if args.print_env:
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))
        return 0
    command = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
    if not command:
        raise ConfigError("cloudckpt run: no command to run; e.g. cloudckpt run -- torchrun "
                          "--nproc-per-node 8 train.py")
    if args.check:
        return doctor.check(command, None, as_json=False, launched=True)
    # Every process of this launch is one attempt of its run (see runtime/attempt.py).
    env.update(attempt.launch_environment())
    if args.run_id:
        env[attempt.RUN_ENV] = args.run_id
    log.info("cloudckpt run: %s=%s for %s", activation.ENV_INTEGRATIONS,
             env[activation.ENV_INTEGRATIONS], shlex.join(command))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, {**os.environ, **env})
    except FileNotFoundError:
        raise ConfigError(f"cloudckpt run: command not found: {command[0]}") from None
    except PermissionError as exc:
        raise ConfigError(f"cloudckpt run: cannot run {command[0]}: {exc}") from None
    return 0  # not reached: exec replaced this process
