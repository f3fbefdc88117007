"""The ``cloudckpt`` command: inspect, verify, copy and delete checkpoints.

Exit codes: 0 success; 1 a checkpoint is corrupt or failed verification;
2 bad usage or configuration; 3 not found; 4 incomplete (no manifest);
5 commit conflict; 6 storage failure; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import __version__
from .checkpoint import delete_checkpoint, latest_checkpoint, list_checkpoints, open_checkpoint
from .errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
)
from .transfer import copy_checkpoint

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3
EXIT_INCOMPLETE, EXIT_CONFLICT, EXIT_STORAGE, EXIT_INTERRUPTED = 4, 5, 6, 130

_EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (CorruptCheckpointError, EXIT_CORRUPT),
    (ConfigError, EXIT_USAGE),
    (CheckpointNotFoundError, EXIT_NOT_FOUND),
    (IncompleteCheckpointError, EXIT_INCOMPLETE),
    (CommitConflictError, EXIT_CONFLICT),
    (StorageError, EXIT_STORAGE),
]


def _parse_options(pairs: Sequence[str] | None) -> dict[str, Any]:
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


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


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


def cmd_ls(args: argparse.Namespace) -> int:
    infos = list_checkpoints(args.root, args.options, include_uncommitted=True)
    if args.json:
        print(json.dumps([i.__dict__ for i in infos], indent=1))
        return EXIT_OK
    if not infos:
        print(f"no checkpoints under {args.root}")
        return EXIT_OK
    print(f"{'NAME':<32} {'STEP':>8} {'CREATED':<19} {'SIZE':>10} {'FILES':>6}  STATUS")
    for i in infos:
        status = "committed" if i.committed else ("UNREADABLE" if i.error else "uncommitted")
        step = "-" if i.step is None else str(i.step)
        print(f"{i.name:<32} {step:>8} {_when(i.created):<19} {_size(i.size):>10} "
              f"{i.files:>6}  {status}")
    return EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    c = open_checkpoint(args.uri, args.options)
    m = c.manifest
    if args.json:
        print(m.to_json().decode())
        return EXIT_OK
    print(f"uri:       {c.uri}\nstep:      {m.step}\nkind:      {m.kind}\n"
          f"created:   {_when(m.created)}\ncommit id: {m.commit_id}\n"
          f"size:      {_size(m.total_size)} in {len(m.files)} objects")
    if m.metadata:
        print(f"metadata:  {json.dumps(dict(m.metadata), sort_keys=True)}")
    for path in c.files:
        e = m.files[path]
        print(f"  {e.crc32c}  {e.size:>12}  {path}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    c = open_checkpoint(args.uri, args.options)
    try:
        c.verify(deep=args.deep)
    except CorruptCheckpointError as exc:
        for path, why in sorted(exc.problems.items()):
            print(f"BAD  {path}: {why}")
        print(f"{c.uri}: {len(exc.problems)} of {len(c.files)} objects failed verification")
        return EXIT_CORRUPT
    print(f"OK   {c.uri}: {len(c.files)} objects, {_size(c.total_size)}"
          f" ({'sizes and CRC32C' if args.deep else 'sizes'} checked)")
    return EXIT_OK


def cmd_latest(args: argparse.Namespace) -> int:
    c = latest_checkpoint(args.root, args.options)
    if c is None:
        raise CheckpointNotFoundError(f"no committed checkpoint under {args.root}")
    print(c.uri)
    return EXIT_OK


def _copy(args: argparse.Namespace, dst: str, dst_options: dict[str, Any]) -> int:
    src = open_checkpoint(args.src, args.options)
    with _progress(src.total_size, "copy") as update:
        out = copy_checkpoint(src, dst, dst_options=dst_options, progress=update)
    print(f"copied {src.uri} -> {out.uri} ({len(out.files)} objects, {_size(out.total_size)})")
    return EXIT_OK


def cmd_cp(args: argparse.Namespace) -> int:
    return _copy(args, args.dst, _parse_options(args.dst_option) or args.options)


def cmd_download(args: argparse.Namespace) -> int:
    args.src = args.uri
    return _copy(args, args.dir, {})


def cmd_rm(args: argparse.Namespace) -> int:
    n = delete_checkpoint(args.uri, args.options, force=args.force)
    print(f"deleted {args.uri} ({n} objects)")
    return EXIT_OK


def cmd_adopt(args: argparse.Namespace) -> int:
    from .dcp import adopt

    c = adopt(args.uri, args.options, step=args.step)
    print(f"adopted {c.uri}: {len(c.files)} objects checked and committed")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from .gc import collect, find_garbage

    garbage = find_garbage(args.root, args.options, grace_seconds=args.grace)
    if not garbage:
        print(f"nothing to collect under {args.root} (grace {args.grace:.0f}s)")
        return EXIT_OK
    for g in garbage:
        print(f"{'remove' if args.yes else 'would remove'}  {g.uri}  ({g.reason}; "
              f"{g.objects} objects, {_size(g.size)}, {g.age_seconds / 3600:.1f} h old)")
    if args.yes:
        n = collect(garbage, args.options)
        print(f"removed {len(garbage)} prefixes ({n} objects)")
    else:
        print("dry run: nothing deleted; pass --yes to delete")
    return EXIT_OK


def cmd_push(args: argparse.Namespace) -> int:
    from .hub import push_to_hub

    url = push_to_hub(args.uri, args.repo_id, revision=args.revision,
                      private=True if args.private else None, create_pr=args.create_pr,
                      commit_message=args.message, storage_options=args.options)
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
        print(f"converted {args.src} -> {out.uri} ({len(out.files)} files)")
    else:
        n = convert.dcp_to_pt(args.dcp_path, args.output_path, key_prefix=args.key_prefix,
                              storage_options=args.options)
        print(f"wrote {n} tensors to {args.output_path}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cloudckpt", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n", 2)[2].strip())
    p.add_argument("--version", action="version", version=f"cloudckpt {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more logging (-vv: cloudckpt's debug, -vvv: every library's)")
    p.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE",
                   help="storage option for the URI (repeatable), e.g. endpoint_url=http://...")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("ls", cmd_ls, "list checkpoints below ROOT (uncommitted prefixes marked)")
    sp.add_argument("root")
    sp.add_argument("--json", action="store_true")
    sp = add("info", cmd_info, "show a checkpoint's manifest")
    sp.add_argument("uri")
    sp.add_argument("--json", action="store_true")
    sp = add("verify", cmd_verify, "check a checkpoint's objects (sizes; --deep: CRC32C too)")
    sp.add_argument("uri")
    sp.add_argument("--deep", action="store_true", help="download every object and check CRC32C")
    sp = add("latest", cmd_latest, "print the URI of the newest committed checkpoint below ROOT")
    sp.add_argument("root")
    sp = add("cp", cmd_cp, "copy a committed checkpoint to DST (verified, then committed)")
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--dst-option", action="append", metavar="KEY=VALUE",
                    help="storage option for DST (default: the -o options)")
    sp = add("download", cmd_download, "download a committed checkpoint to a local directory")
    sp.add_argument("uri")
    sp.add_argument("dir")
    sp = add("adopt", cmd_adopt, "commit a DCP checkpoint written without cloudckpt, after "
             "checking every object its .metadata references")
    sp.add_argument("uri")
    sp.add_argument("--step", type=int, default=None, help="step number to record")
    sp = add("gc", cmd_gc, "remove uncommitted prefixes and orphan slot generations older "
             "than a grace period (dry run unless --yes)")
    sp.add_argument("root")
    sp.add_argument("--grace", type=float, default=6 * 3600.0, metavar="SECONDS",
                    help="only collect what is older than this (default: 6 hours)")
    sp.add_argument("--yes", action="store_true", help="really delete")
    sp = add("push", cmd_push, "verify an HF export, then push it to the Hugging Face Hub")
    sp.add_argument("uri")
    sp.add_argument("repo_id")
    sp.add_argument("--revision", default="main")
    sp.add_argument("--private", action="store_true", help="create the repo private")
    sp.add_argument("--create-pr", action="store_true", help="open a pull request")
    sp.add_argument("--message", default=None, help="commit message")
    sp = add("convert", cmd_convert, "convert a DCP checkpoint's model to HF or torch.save")
    conv = sp.add_subparsers(dest="what", required=True, metavar="KIND")
    c = conv.add_parser("dcp-to-hf", help="DCP model tensors -> HF safetensors export")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--config", required=True, help="config.json of the model")
    c.add_argument("--key-prefix", default=None, help="model keys' prefix (default: auto)")
    c.add_argument("--dtype", default=None, help="bf16, fp16 or fp32")
    c.add_argument("--max-shard-size", default="5GB")
    c = conv.add_parser("dcp-to-pt", help="DCP model tensors -> torch.save state dict "
                        "(RLinf's converter arguments)")
    c.add_argument("--dcp_path", "--dcp-path", dest="dcp_path", required=True)
    c.add_argument("--output_path", "--output-path", dest="output_path", required=True)
    c.add_argument("--key-prefix", default=None, help="model keys' prefix (default: auto)")
    sp = add("rm", cmd_rm, "delete a checkpoint (manifest first, then its objects)")
    sp.add_argument("uri")
    sp.add_argument("--force", action="store_true", help="also delete an uncommitted prefix")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # -vv is ours only: the HTTP libraries' debug lines quote request headers.
    level = [logging.WARNING, logging.INFO, logging.INFO, logging.DEBUG][min(args.verbose, 3)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose >= 2:
        logging.getLogger("cloudckpt").setLevel(logging.DEBUG)
    try:
        args.options = _parse_options(args.storage_option)
        return int(args.fn(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except CloudCkptError as exc:
        print(f"cloudckpt: error: {exc}", file=sys.stderr)
        for cls, code in _EXIT_CODES:
            if isinstance(exc, cls):
                return code
        return EXIT_STORAGE


if __name__ == "__main__":
    sys.exit(main())
