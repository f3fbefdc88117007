"""The ``cloudckpt`` command: inspect, verify, copy and delete checkpoints.

Every failure is a cloudckpt error with its own exit code (:data:`EXIT_CODES`,
listed in docs/cli.md); a raw traceback is shown only with ``-vv``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import __version__
from .checkpoint import (
    delete_checkpoint,
    delete_tree,
    latest_checkpoint,
    list_checkpoints,
    open_checkpoint,
)
from .errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointNotFoundError,
    CloudCkptError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    DiskFullError,
    IncompleteCheckpointError,
    NotACheckpointError,
    StorageError,
)
from .ownership import COMMITTED, EMPTY, OURS, ROOT, describe_root, incomplete, not_a_checkpoint
from .ownership import survey as survey_prefix
from .storage import open_store
from .transfer import copy_checkpoint

log = logging.getLogger("cloudckpt")

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3
EXIT_INCOMPLETE, EXIT_CONFLICT, EXIT_STORAGE = 4, 5, 6
EXIT_ACCESS, EXIT_DISK_FULL, EXIT_INTERNAL = 7, 8, 70
EXIT_INTERRUPTED, EXIT_PIPE = 130, 141

#: Error class -> exit code; the first match wins, so subclasses come first.
EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (DiskFullError, EXIT_DISK_FULL),
    (AccessDeniedError, EXIT_ACCESS),
    (BucketNotFoundError, EXIT_NOT_FOUND),
    (CorruptCheckpointError, EXIT_CORRUPT),
    (ConfigError, EXIT_USAGE),
    (NotACheckpointError, EXIT_USAGE),
    (CheckpointNotFoundError, EXIT_NOT_FOUND),
    (IncompleteCheckpointError, EXIT_INCOMPLETE),
    (CommitConflictError, EXIT_CONFLICT),
    (StorageError, EXIT_STORAGE),
]

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

Storage options go with -o KEY=VALUE, before or after the command; the standard
environment (AWS_*, STORAGE_EMULATOR_HOST, GOOGLE_APPLICATION_CREDENTIALS) works too.
See docs/cli.md."""


def parse_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are JSON when they parse as JSON, else strings."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"storage option {pair!r} must look like KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _when(t: float | None) -> str:
    """Local time with its UTC offset, so times read alike anywhere."""
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t)) if t else "-"


@contextmanager
def _progress(total: int, desc: str):
    """A tqdm bar on a terminal; nothing when stderr is not a TTY."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
               disable=not sys.stderr.isatty(), leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


_STATUS_LABEL = {"committed": "committed", "uncommitted": "uncommitted (no manifest)",
                 "unreadable": "UNREADABLE", "root": "root (checkpoints below)",
                 "foreign": "not cloudckpt's"}


def cmd_ls(args: argparse.Namespace) -> int:
    infos = list_checkpoints(args.root, args.options, include_uncommitted=True)
    if args.json:
        print(json.dumps([i.__dict__ for i in infos], indent=1))
        return EXIT_OK
    if not infos:
        print(f"no checkpoints under {args.root}")
        return EXIT_OK
    print(f"{'NAME':<32} {'STEP':>8} {'TIME':<25} {'SIZE':>10} {'FILES':>6}  STATUS")
    for i in infos:
        step = "-" if i.step is None else str(i.step)
        print(f"{i.name:<32} {step:>8} {_when(i.created):<25} {_size(i.size):>10} "
              f"{i.files:>6}  {_STATUS_LABEL.get(i.status, i.status)}")
    return EXIT_OK


_INFO_FILES = 20


def cmd_info(args: argparse.Namespace) -> int:
    c = open_checkpoint(args.uri, args.options)
    m = c.manifest
    if args.json:
        print(m.to_json().decode())
        return EXIT_OK
    print(f"uri:       {c.uri}\nstep:      {m.step}\nkind:      {m.kind}\n"
          f"created:   {_when(m.created)}\ncommit id: {m.commit_id}\n"
          f"size:      {_size(m.total_size)} in {_plural(len(m.files), 'object')}")
    if m.metadata:
        text = json.dumps(dict(m.metadata), sort_keys=True)
        print(f"metadata:  {text if args.all or len(text) <= 500 else text[:500] + ' ...'}")
    shown = c.files if args.all else c.files[:_INFO_FILES]
    for path in shown:
        e = m.files[path]
        print(f"  {e.crc32c}  {e.size:>12}  {path}")
    if len(shown) < len(c.files):
        print(f"  ... and {_plural(len(c.files) - len(shown), 'more object')} "
              "(--all lists every one, --json prints the manifest)")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    c = open_checkpoint(args.uri, args.options)
    try:
        c.verify(deep=args.deep)
    except CorruptCheckpointError as exc:
        for path, why in sorted(exc.problems.items()):
            print(f"BAD  {path}: {why}")
        print(f"{c.uri}: {len(exc.problems)} of {_plural(len(c.files), 'object')} failed "
              "verification")
        return EXIT_CORRUPT
    print(f"OK   {c.uri}: {_plural(len(c.files), 'object')}, {_size(c.total_size)}"
          f" ({'sizes and CRC32C' if args.deep else 'sizes'} checked)")
    return EXIT_OK


def cmd_latest(args: argparse.Namespace) -> int:
    c = latest_checkpoint(args.root, args.options)
    if c is None:
        raise CheckpointNotFoundError(f"no committed checkpoint under {args.root}")
    print(c.uri)
    return EXIT_OK


def _copy(args: argparse.Namespace, src_uri: str, dst: str, dst_options: dict[str, Any],
          label: str) -> int:
    src = open_checkpoint(src_uri, args.options)
    with _progress(src.total_size, label) as update:
        out = copy_checkpoint(src, dst, dst_options=dst_options, progress=update)
    print(f"{label}: {src.uri} -> {out.uri} ({_plural(len(out.files), 'object')}, "
          f"{_size(out.total_size)})")
    return EXIT_OK


def cmd_cp(args: argparse.Namespace) -> int:
    return _copy(args, args.src, args.dst, parse_options(args.dst_option) or args.options,
                 "copy")


def cmd_download(args: argparse.Namespace) -> int:
    return _copy(args, args.uri, args.dir, {}, "download")


def cmd_rm(args: argparse.Namespace) -> int:
    store = open_store(args.uri, args.options)
    found = survey_prefix(store)
    if found.kind == COMMITTED:  # --force: even with a manifest that cannot be read
        n = delete_checkpoint(store, force=args.force)
        print(f"deleted {store.uri} ({_plural(n, 'object')})")
        return EXIT_OK
    if found.kind == OURS:
        if not args.force:
            raise incomplete(found)
        n = delete_checkpoint(store, force=True)
        print(f"deleted the unfinished save at {store.uri} ({_plural(n, 'object')})")
        return EXIT_OK
    if found.kind == EMPTY:
        store.check_bucket()
        raise not_a_checkpoint(found)
    if found.kind != ROOT:
        raise NotACheckpointError(f"{not_a_checkpoint(found)} Nothing was deleted: cloudckpt "
                                  "deletes only what it wrote.")
    if not args.recursive:
        raise NotACheckpointError(
            f"{store.uri} is {describe_root(found)}; nothing was deleted. `cloudckpt rm "
            f"--recursive {store.uri}` deletes every checkpoint below it (after asking; --yes "
            "does not ask) and leaves every object cloudckpt did not write.")
    print(f"{store.uri} is {describe_root(found)}:")
    for prefix in found.checkpoints:
        print(f"  {store.child(prefix).uri}")
    if not _confirm(args, f"delete these {_plural(len(found.checkpoints), 'checkpoint')} "
                    "and any unfinished saves of cloudckpt's there?"):
        print("nothing deleted")
        return EXIT_OK
    deleted, n, before = delete_tree(store)
    print(f"deleted {_plural(len(deleted), 'checkpoint or unfinished save')} "
          f"({_plural(n, 'object')}) below {store.uri}")
    if before.foreign:
        print(f"left {_plural(len(before.foreign), 'object')} cloudckpt did not write, e.g. "
              f"{before.foreign[0]}")
    return EXIT_OK


def _confirm(args: argparse.Namespace, question: str) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise ConfigError(f"{question} Not asked: the input is not a terminal; pass --yes "
                          "to confirm")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def cmd_adopt(args: argparse.Namespace) -> int:
    from .dcp import adopt

    c = adopt(args.uri, args.options, step=args.step)
    print(f"adopted {c.uri}: {_plural(len(c.files), 'object')} checked and committed")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from .gc import collect, find_garbage

    garbage = find_garbage(args.root, args.options, grace_seconds=args.grace)
    if not garbage:
        print(f"nothing to collect under {args.root} (grace {args.grace:.0f} s)")
        return EXIT_OK
    for g in garbage:
        print(f"{'remove' if args.yes else 'would remove'}  {g.uri}  ({g.reason}; "
              f"{_plural(g.objects, 'object')}, {_size(g.size)}, "
              f"{g.age_seconds / 3600:.1f} h old)")
    total = sum(g.objects for g in garbage)
    if args.yes:
        n = collect(garbage, args.options)
        print(f"removed {_plural_prefix(len(garbage))} ({_plural(n, 'object')})")
    else:
        print(f"dry run: nothing deleted; --yes deletes {_plural_prefix(len(garbage))} "
              f"({_plural(total, 'object')})")
    return EXIT_OK


def _plural_prefix(n: int) -> str:
    return f"{n} prefix{'' if n == 1 else 'es'}"


def cmd_push(args: argparse.Namespace) -> int:
    from .hub import push_to_hub

    url = push_to_hub(args.uri, args.repo_id, revision=args.revision,
                      private=True if args.private else None, create_pr=args.create_pr,
                      commit_message=args.message, storage_options=args.options,
                      endpoint=args.endpoint, token=args.token)
    print(url)
    return EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    from . import convert

    dtype = None
    if getattr(args, "dtype", None):
        if args.dtype not in convert.DTYPES:
            raise ConfigError(f"unknown --dtype {args.dtype!r}; use {sorted(convert.DTYPES)}")
        dtype = convert.DTYPES[args.dtype]
    if args.what == "dcp-to-hf":
        try:
            config = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read --config {args.config}: {exc}") from None
        out = convert.dcp_to_hf(args.src, args.dst, config=config, key_prefix=args.key_prefix,
                                dtype=dtype, max_shard_size=args.max_shard_size,
                                storage_options=args.options)
        print(f"converted {args.src} -> {out.uri} ({_plural(len(out.files), 'file')})")
    else:
        n = convert.dcp_to_pt(args.dcp_path, args.output_path, key_prefix=args.key_prefix,
                              storage_options=args.options)
        print(f"wrote {_plural(n, 'tensor')} to {args.output_path}")
    return EXIT_OK


def _common(dest_suffix: str) -> argparse.ArgumentParser:
    """-v and -o, taken before or after the command (merged in :func:`main`)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-v", "--verbose", action="count", default=0, dest=f"verbose{dest_suffix}",
                   help="more logging (-v: progress, -vv: cloudckpt's debug and tracebacks, "
                   "-vvv: every library's debug)")
    p.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE",
                   dest=f"storage_option{dest_suffix}",
                   help="storage option for the URI (repeatable), e.g. endpoint_url=http://...")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cloudckpt", parents=[_common("")],
        description="Inspect, verify, copy and delete crash-safe PyTorch checkpoints on S3, "
        "GCS, local disk or any fsspec URL.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"cloudckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="what to do (COMMAND --help says more)")
    common = _common("_sub")

    def add(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, parents=[common])
        sp.set_defaults(fn=fn)
        return sp

    sp = add("ls", cmd_ls, "list the checkpoints below ROOT, and what else lies there")
    sp.add_argument("root", help="the run directory, e.g. s3://bucket/run")
    sp.add_argument("--json", action="store_true", help="print the listing as JSON")
    sp = add("info", cmd_info, "show a checkpoint's manifest")
    sp.add_argument("uri", help="the checkpoint, e.g. s3://bucket/run/step-100")
    sp.add_argument("--json", action="store_true", help="print the manifest itself")
    sp.add_argument("--all", action="store_true",
                    help=f"list every object (default: the first {_INFO_FILES})")
    sp = add("verify", cmd_verify, "check a checkpoint's objects (sizes; --deep: CRC32C too)")
    sp.add_argument("uri", help="the checkpoint")
    sp.add_argument("--deep", action="store_true", help="download every object and check CRC32C")
    sp = add("latest", cmd_latest, "print the URI of the newest committed checkpoint below ROOT")
    sp.add_argument("root", help="the run directory")
    sp = add("cp", cmd_cp, "copy a committed checkpoint to DST (verified, then committed); "
             "rerunning an interrupted copy resumes it")
    sp.add_argument("src", help="the checkpoint to copy")
    sp.add_argument("dst", help="where the copy goes: a new URI, not a root holding checkpoints")
    sp.add_argument("--dst-option", action="append", metavar="KEY=VALUE",
                    help="storage option for DST (default: the -o options)")
    sp = add("download", cmd_download, "download a committed checkpoint to a local directory; "
             "rerunning an interrupted download resumes it")
    sp.add_argument("uri", help="the checkpoint")
    sp.add_argument("dir", help="a new or empty local directory")
    sp = add("adopt", cmd_adopt, "commit a DCP checkpoint written without cloudckpt, after "
             "checking every object its .metadata references")
    sp.add_argument("uri", help="the DCP checkpoint's directory")
    sp.add_argument("--step", type=int, default=None, help="step number to record")
    sp = add("gc", cmd_gc, "remove unfinished saves cloudckpt left below ROOT and orphan slot "
             "generations, older than a grace period (dry run unless --yes)")
    sp.add_argument("root", help="the run directory")
    sp.add_argument("--grace", type=float, default=6 * 3600.0, metavar="SECONDS",
                    help="only collect what is older than this (default: 6 hours)")
    sp.add_argument("--yes", action="store_true", help="really delete")
    sp = add("push", cmd_push, "verify an HF export, then push it to the Hugging Face Hub")
    sp.add_argument("uri", help="the committed HF export")
    sp.add_argument("repo_id", help="the Hub repository, e.g. my-org/my-model")
    sp.add_argument("--revision", default="main", help="branch to commit to (default: main)")
    sp.add_argument("--private", action="store_true", help="create the repo private")
    sp.add_argument("--create-pr", action="store_true", help="open a pull request")
    sp.add_argument("--message", default=None, help="commit message")
    sp.add_argument("--endpoint", default=None,
                    help="Hub URL (default: HF_ENDPOINT, else huggingface.co)")
    sp.add_argument("--token", default=None,
                    help="Hub token with write access (default: HF_TOKEN or a saved login)")
    sp = add("convert", cmd_convert, "convert a DCP checkpoint's model to HF or torch.save")
    conv = sp.add_subparsers(dest="what", required=True, metavar="KIND",
                             help="dcp-to-hf or dcp-to-pt")
    c = conv.add_parser("dcp-to-hf", help="DCP model tensors -> HF safetensors export",
                        parents=[common])
    c.add_argument("src", help="the DCP (or training) checkpoint")
    c.add_argument("dst", help="where the HF export goes")
    c.add_argument("--config", required=True, help="config.json of the model")
    c.add_argument("--key-prefix", default=None, help="model keys' prefix (default: auto)")
    c.add_argument("--dtype", default=None, help="bf16, fp16 or fp32")
    c.add_argument("--max-shard-size", default="5GB", help="largest shard (default: 5GB)")
    c = conv.add_parser("dcp-to-pt", help="DCP model tensors -> torch.save state dict "
                        "(RLinf's converter arguments)", parents=[common])
    c.add_argument("--dcp_path", "--dcp-path", dest="dcp_path", required=True,
                   help="the DCP checkpoint")
    c.add_argument("--output_path", "--output-path", dest="output_path", required=True,
                   help="the .pt file to write")
    c.add_argument("--key-prefix", default=None, help="model keys' prefix (default: auto)")
    sp = add("rm", cmd_rm, "delete a committed checkpoint (manifest first, then its objects)")
    sp.add_argument("uri", help="the checkpoint (taken literally: no wildcards)")
    sp.add_argument("--force", action="store_true",
                    help="also delete an unfinished save that cloudckpt left there, or a "
                    "checkpoint whose manifest cannot be read")
    sp.add_argument("--recursive", action="store_true",
                    help="on a root: delete every checkpoint below it (asks first)")
    sp.add_argument("--yes", action="store_true", help="do not ask before --recursive deletes")
    return p


def _report(exc: CloudCkptError) -> int:
    print(f"cloudckpt: error: {exc}", file=sys.stderr)
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return EXIT_STORAGE


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose = args.verbose + getattr(args, "verbose_sub", 0)
    # -vv is ours only: the HTTP libraries' debug lines quote request headers.
    level = [logging.WARNING, logging.INFO, logging.INFO, logging.DEBUG][min(args.verbose, 3)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose >= 2:
        logging.getLogger("cloudckpt").setLevel(logging.DEBUG)
    try:
        try:
            args.options = parse_options((args.storage_option or [])
                                         + (getattr(args, "storage_option_sub", None) or []))
            code = int(args.fn(args))
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
