"""The ``cloudckpt`` command: inspect, verify, copy and delete checkpoints.

The parser and ``main`` live here, the commands in :mod:`.commands`, the printing
helpers in :mod:`.output`, the frameworks' commands (``cloudckpt NAME ...``, one per
framework :mod:`cloudckpt.core.plugins` declares, loaded only when named) in
:mod:`.frameworks`; the options every level takes (``-v``, ``-o``) are
:mod:`cloudckpt.util.cliargs`'s, the exit codes (one per kind of failure, listed in
docs/cli.md) :mod:`cloudckpt.errors`'s. Every failure, a framework command's too, is a
cloudckpt error with its exit code; a raw traceback is shown only with ``-vv``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from cloudckpt import __version__
from cloudckpt.cli.commands import (
    INFO_FILES_SHOWN,
    cmd_adopt,
    cmd_convert,
    cmd_cp,
    cmd_dcp_stock,
    cmd_download,
    cmd_gc,
    cmd_info,
    cmd_latest,
    cmd_ls,
    cmd_push,
    cmd_rm,
    cmd_verify,
)
from cloudckpt.cli.doctor import add_doctor, cmd_doctor
from cloudckpt.cli.frameworks import LazySubcommands, add_frameworks
from cloudckpt.cli.inspecting import add_contents
from cloudckpt.cli.run import add_run, cmd_run
from cloudckpt.errors import (  # noqa: F401 - the exit codes are part of the command's interface
    EXIT_ACCESS,
    EXIT_CODES,
    EXIT_CONFLICT,
    EXIT_CORRUPT,
    EXIT_DISK_FULL,
    EXIT_INCOMPLETE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PIPE,
    EXIT_STORAGE,
    EXIT_USAGE,
    CloudCkptError,
    exit_code,
)
from cloudckpt.storage import parse_options
from cloudckpt.util import logsetup
from cloudckpt.util.cliargs import (
    COMMAND,
    TOP,
    add_command,
    common_options,
    option_pairs,
    verbosity,
)

log = logging.getLogger(__name__)

_EPILOG = """\
exit codes:
  0    success
  1    a checkpoint is corrupt or failed verification
  2    bad usage, option or configuration; the URI is a root or holds data cloudckpt
       did not write; the state to load does not match the checkpoint
  3    not found: no checkpoint, or no such bucket, at the URI
  4    incomplete: a save that never committed (no manifest)
  5    conflict: a checkpoint is already there, or another save holds the URI
  6    storage failure (retries exhausted, or the store refused the request)
  7    access denied, or no credentials (storage or the Hugging Face Hub)
  8    the local disk is full, or a file exceeds the file size limit
  70   internal error (a bug: rerun with -vv and report the traceback)
  130  interrupted
  141  the output was closed (e.g. piped into head)

Storage options go with -o KEY=VALUE, before or after the command (and a framework's
subcommand); the standard environment (AWS_*, STORAGE_EMULATOR_HOST,
GOOGLE_APPLICATION_CREDENTIALS) works too. A framework's commands are listed by
`cloudckpt NAME --help`. See docs/cli.md."""


def _top() -> tuple[argparse.ArgumentParser, LazySubcommands]:
    """The ``cloudckpt`` parser and its (still empty) commands."""
    p = argparse.ArgumentParser(
        prog="cloudckpt", parents=[common_options(TOP)],
        description="Inspect, verify, copy and delete crash-safe PyTorch checkpoints on S3, "
        "GCS, local disk or any fsspec URL.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"cloudckpt {__version__}")
    sub = p.add_subparsers(action=LazySubcommands, dest="command", required=True,
                           metavar="COMMAND", help="what to do (COMMAND --help says more)")
    return p, sub  # type: ignore[return-value]  # an instance of action=, which typeshed does not follow


def _add(sub: LazySubcommands, name: str, fn: Any, help: str) -> argparse.ArgumentParser:
    return add_command(sub, name, fn, help, level=COMMAND)


def _add_inspection(sub: LazySubcommands) -> None:
    """ls, info, verify, latest."""
    sp = _add(sub, "ls", cmd_ls, "list the checkpoints below ROOT, and what else lies there")
    sp.add_argument("root", help="the run directory, e.g. s3://bucket/run")
    sp.add_argument("--json", action="store_true", help="print the listing as JSON")
    sp.add_argument("--no-index", action="store_true",
                    help="read every manifest and survey every prefix, rather than what the "
                    "root's index records (which is left as it is)")
    sp = _add(sub, "info", cmd_info, "show a checkpoint's manifest")
    sp.add_argument("uri", help="the checkpoint, e.g. s3://bucket/run/step-100")
    sp.add_argument("--json", action="store_true", help="print the manifest itself")
    sp.add_argument("--all", action="store_true",
                    help=f"list every object (default: the first {INFO_FILES_SHOWN})")
    sp = _add(sub, "verify", cmd_verify, "check a checkpoint's objects (sizes; --deep: CRC32C "
              "too)")
    sp.add_argument("uri", help="the checkpoint")
    sp.add_argument("--deep", action="store_true", help="download every object and check CRC32C")
    sp = _add(sub, "latest", cmd_latest, "print the URI of the newest committed checkpoint "
              "below ROOT")
    sp.add_argument("root", help="the run directory")


def _add_transfers(sub: LazySubcommands) -> None:
    """cp, download."""
    sp = _add(sub, "cp", cmd_cp, "copy a committed checkpoint to DST (verified, then "
              "committed); rerunning an interrupted copy resumes it")
    sp.add_argument("src", help="the checkpoint to copy")
    sp.add_argument("dst", help="where the copy goes: a new URI, not a root holding checkpoints")
    sp.add_argument("--dst-option", action="append", metavar="KEY=VALUE",
                    help="storage option for DST (default: the -o options)")
    sp = _add(sub, "download", cmd_download, "download a committed checkpoint, or a run "
              "directory (every checkpoint below it, each recover slot as its current "
              "generation), to a local directory; rerunning an interrupted download resumes it")
    sp.add_argument("uri", help="the checkpoint or run directory")
    sp.add_argument("dir", help="a new or empty local directory")


def _add_upkeep(sub: LazySubcommands) -> None:
    """adopt, gc, rm."""
    sp = _add(sub, "adopt", cmd_adopt, "commit a DCP checkpoint written without cloudckpt, "
              "after checking every object its .metadata references")
    sp.add_argument("uri", help="the DCP checkpoint's directory")
    sp.add_argument("--step", type=int, default=None, help="step number to record")
    sp = _add(sub, "gc", cmd_gc, "remove unfinished saves cloudckpt left below ROOT and orphan "
              "slot generations, older than a grace period (dry run unless --yes)")
    sp.add_argument("root", help="the run directory")
    sp.add_argument("--grace", type=float, default=6 * 3600.0, metavar="SECONDS",
                    help="only collect what is older than this (default: 6 hours)")
    sp.add_argument("--yes", action="store_true", help="really delete")
    sp = _add(sub, "rm", cmd_rm, "delete a committed checkpoint (manifest first, then its "
              "objects)")
    sp.add_argument("uri", help="the checkpoint (taken literally: no wildcards)")
    sp.add_argument("--force", action="store_true",
                    help="also delete an unfinished save that cloudckpt left there, or a "
                    "checkpoint whose manifest cannot be read")
    sp.add_argument("--recursive", action="store_true",
                    help="on a root: delete every checkpoint below it (asks first)")
    sp.add_argument("--yes", action="store_true", help="do not ask before --recursive deletes")


def _add_push(sub: LazySubcommands) -> None:
    sp = _add(sub, "push", cmd_push, "verify an HF export, then push it to the Hugging Face Hub")
    sp.add_argument("uri", help="the committed HF export")
    sp.add_argument("repo_id", help="the Hub repository, e.g. my-org/my-model")
    sp.add_argument("--revision", default="main", help="branch to commit to (default: main)")
    sp.add_argument("--private", action="store_true", help="create the repo private")
    sp.add_argument("--create-pr", action="store_true", help="open a pull request")
    sp.add_argument("--replace", action="store_true",
                    help="delete, in the same commit, the weight files at the repo's root "
                    "that the export does not have (*.safetensors, pytorch_model*.bin, "
                    "*.index.json); without it such files make push refuse (exit 5)")
    sp.add_argument("--message", default=None, help="commit message")
    sp.add_argument("--files-per-commit", type=int, default=None, metavar="N",
                    help="commit in batches of at most N operations (for a Hub that limits "
                    "them), the index, config.json and deletions in the last")
    sp.add_argument("--endpoint", default=None,
                    help="Hub URL (default: HF_ENDPOINT, else huggingface.co)")
    sp.add_argument("--token", default=None,
                    help="Hub token with write access (default: HF_TOKEN or a saved login)")


def _add_convert(sub: LazySubcommands) -> None:
    sp = _add(sub, "convert", cmd_convert, "convert a DCP checkpoint's model to HF or "
              "torch.save")
    conv = sp.add_subparsers(dest="what", required=True, metavar="KIND",
                             help="dcp-to-hf or dcp-to-pt")
    c = add_command(conv, "dcp-to-hf", cmd_convert, "DCP model tensors -> HF safetensors "
                    "export")
    c.add_argument("src", help="the DCP (or training) checkpoint")
    c.add_argument("dst", help="where the HF export goes")
    c.add_argument("--config", required=True, help="config.json of the model")
    c.add_argument("--key-prefix", default=None, help="model keys' prefix (default: auto)")
    c.add_argument("--dtype", default=None, help="bf16, fp16 or fp32")
    c.add_argument("--max-shard-size", default="5GB", help="largest shard (default: 5GB)")
    c = add_command(conv, "dcp-to-pt", cmd_convert, "DCP model tensors -> torch.save state "
                    "dict (--dcp_path and --output_path, as converter scripts spell them)")
    c.add_argument("--dcp_path", "--dcp-path", dest="dcp_path", required=True,
                   help="the DCP checkpoint")
    c.add_argument("--output_path", "--output-path", dest="output_path", required=True,
                   help="the .pt file to write")
    c.add_argument("--key-prefix", default=None, help="model keys' prefix (default: auto)")


def _add_dcp(sub: LazySubcommands) -> None:
    sp = _add(sub, "dcp", cmd_dcp_stock, "DCP checkpoints' own operations")
    dcp = sp.add_subparsers(dest="what", required=True, metavar="ACTION", help="stock")
    c = add_command(dcp, "stock", cmd_dcp_stock, "write the stock .metadata of an indexed "
                    "DCP checkpoint (for torch's own readers), built from its index and "
                    "every rank's records")
    c.add_argument("uri", help="the DCP checkpoint")
    c.add_argument("--output", required=True, metavar="PATH",
                   help="the local file to write (e.g. DIR/.metadata beside a copy)")


def _add_run(sub: LazySubcommands) -> None:
    sp = _add(sub, "run", cmd_run, "run a launch command with the frameworks' integrations "
              "activated in it and every Python process it starts")
    add_run(sp)
    sp = _add(sub, "doctor", cmd_doctor, "say what a framework launch will do with each path "
              "its config names (bucket, local, refused) before anything runs")
    add_doctor(sp)


def build_parser() -> argparse.ArgumentParser:
    """The ``cloudckpt`` parser: its own commands, then one per framework (whose
    arguments are added only once that framework's name is parsed)."""
    p, sub = _top()
    _add_inspection(sub)
    add_contents(sub)
    _add_transfers(sub)
    _add_upkeep(sub)
    _add_push(sub)
    _add_convert(sub)
    _add_dcp(sub)
    _add_run(sub)
    add_frameworks(sub)
    return p


def _report(exc: CloudCkptError) -> int:
    print(f"cloudckpt: error: {exc}", file=sys.stderr)
    return exit_code(exc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose = verbosity(args)
    # -vv is ours only: the HTTP libraries' debug lines quote request headers.
    logsetup.configure(args.verbose)
    try:
        try:
            args.options = parse_options(option_pairs(args))
            code = int(args.func(args))
            sys.stdout.flush()  # a closed pipe shows here, not at exit
            return code
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except CloudCkptError as exc:
            if args.verbose >= 2:
                log.debug("traceback", exc_info=True)
            return _report(exc)
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): end quietly, as a command killed by
        # SIGPIPE does; point stdout at /dev/null so the exit does not complain again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except Exception as exc:  # noqa: BLE001 - a bug: one line, the traceback with -vv
        if args.verbose >= 2:
            raise
        print(f"cloudckpt: internal error: {type(exc).__name__}: {exc}. This is a bug in "
              "cloudckpt: rerun with -vv for the traceback and report it.", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
