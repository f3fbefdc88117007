"""The commands of ``cloudckpt``: one function each, taking the parsed arguments."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from cloudckpt.cli.output import plural, plural_prefix, progress, size, when
from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.deletion import delete_checkpoint, delete_tree, delete_unfinished
from cloudckpt.core.listing import latest_checkpoint, list_root
from cloudckpt.core.ownership import (
    COMMITTED,
    EMPTY,
    OURS,
    ROOT,
    Survey,
    describe_root,
    incomplete,
    not_a_checkpoint,
)
from cloudckpt.core.ownership import survey as survey_prefix
from cloudckpt.errors import (
    EXIT_CORRUPT,
    EXIT_OK,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from cloudckpt.movement.checkpoint_copy import copy_checkpoint
from cloudckpt.movement.trees import tree_units
from cloudckpt.names import DCP_INDEX_NAME, MANIFEST_NAME
from cloudckpt.storage import Store, open_store, parse_options, versioning

_STATUS_LABEL = {"committed": "committed", "uncommitted": "uncommitted (no manifest)",
                 "unreadable": "UNREADABLE", "root": "root (checkpoints below)",
                 "part": "part of an uncommitted save (not a checkpoint)",
                 "foreign": "not cloudckpt's"}


def _root(uri: str, options: dict[str, Any], command: str, *, checked: bool = True) -> Store:
    """The run directory a command was given; a checkpoint given instead, or a local
    path that does not exist (a bare name meant as a bucket URI), is refused saying
    what to pass. ``checked=False`` leaves the first check to the caller
    (:func:`_not_a_checkpoint`)."""
    store = open_store(uri, options)
    if checked:
        _not_a_checkpoint(store, command)
    if store.protocol in ("file", "") and not os.path.isdir(store.root):
        raise CheckpointNotFoundError(
            f"{uri!r} was taken as a local path, and {store.root} does not exist. For a "
            f"bucket give its URI (e.g. s3://{uri.strip('/')} or gs://{uri.strip('/')})")
    return store


def _not_a_checkpoint(store: Store, command: str) -> None:
    """Refuse a checkpoint given where a run directory belongs."""
    if store.exists(MANIFEST_NAME):
        parent = store.uri.rpartition("/")[0] or store.uri
        raise ConfigError(
            f"{store.uri} is a checkpoint, not a run directory: `cloudckpt {command}` takes "
            f"the directory holding checkpoints, e.g. {parent}; `cloudckpt info "
            f"{store.uri}` shows this one")


def cmd_ls(args: argparse.Namespace) -> int:
    store = _root(args.root, args.options, "ls", checked=False)
    listing = list_root(store, include_uncommitted=True, index=not args.no_index)
    if not listing.indexed:  # a root index is never in a checkpoint: no need to ask then
        _not_a_checkpoint(store, "ls")
    infos = listing.infos
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=1))
        return EXIT_OK
    if not infos:
        print(f"no checkpoints under {args.root}")
        return EXIT_OK
    print(f"{'NAME':<32} {'STEP':>8} {'TIME':<25} {'SIZE':>10} {'FILES':>6}  STATUS")
    for i in infos:
        step = "-" if i.step is None else str(i.step)
        print(f"{i.name:<32} {step:>8} {when(i.created):<25} {size(i.size):>10} "
              f"{i.files:>6}  {_STATUS_LABEL.get(i.status, i.status)}")
    return EXIT_OK


#: The objects ``cloudckpt info`` lists without ``--all``.
INFO_FILES_SHOWN = 20


def cmd_info(args: argparse.Namespace) -> int:
    c = open_checkpoint(args.uri, args.options)
    m = c.manifest
    if args.json:
        print(m.to_json().decode())
        return EXIT_OK
    print(f"uri:       {c.uri}\nstep:      {m.step}\nkind:      {m.kind}\n"
          f"created:   {when(m.created)}\ncommit id: {m.commit_id}\n"
          f"size:      {size(m.total_size)} in {plural(len(m.files), 'object')}")
    if m.blob_depth is not None:
        print(f"blobs:     {plural(len(m.blobs), 'object')} in the run's blob area "
              f"({m.blob_depth} level(s) up): an incremental save")
    if m.writer_area is not None:
        print(f"moved:     {plural(len(m.moved), 'object')} in {m.writer_area} "
              f"({m.writer_depth} level(s) up): a save that took the prefix over")
    if m.metadata:
        text = json.dumps(dict(m.metadata), sort_keys=True)
        print(f"metadata:  {text if args.all or len(text) <= 500 else text[:500] + ' ...'}")
    shown = c.files if args.all else c.files[:INFO_FILES_SHOWN]
    for path in shown:
        e = m.files[path]
        print(f"  {e.crc32c}  {e.size:>12}  {path}"
              + (f"  (blob {e.blob[:12]})" if e.blob else "  (moved)" if e.moved else ""))
    if len(shown) < len(c.files):
        print(f"  ... and {plural(len(c.files) - len(shown), 'more object')} "
              "(--all lists every one, --json prints the manifest)")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    c = open_checkpoint(args.uri, args.options)
    try:
        c.verify(deep=args.deep)
    except CorruptCheckpointError as exc:
        for path, why in sorted(exc.problems.items()):
            print(f"BAD  {path}: {why}")
        print(f"{c.uri}: {len(exc.problems)} of {plural(len(c.files), 'object')} failed "
              "verification")
        return EXIT_CORRUPT
    print(f"OK   {c.uri}: {plural(len(c.files), 'object')}, {size(c.total_size)}"
          f" ({'sizes and CRC32C' if args.deep else 'sizes'} checked)")
    return EXIT_OK


def cmd_latest(args: argparse.Namespace) -> int:
    store = _root(args.root, args.options, "latest")
    c = latest_checkpoint(store)
    if c is None:
        found = survey_prefix(store)
        if found.kind == OURS:  # a torn save or copy, whose committed parts are no checkpoints
            raise incomplete(found)
        raise CheckpointNotFoundError(f"no committed checkpoint under {args.root}")
    print(c.uri)
    return EXIT_OK


def _copy(pairs: list[tuple[Checkpoint, str]], dst_options: dict[str, Any],
          label: str) -> int:
    """Copy each (checkpoint, destination), under one progress bar; what was copied is
    printed once the bar is finished, a failure's copies done before it too."""
    done = []
    try:
        with progress(sum(src.total_size for src, _ in pairs), label) as update:
            for src, dst in pairs:
                out = copy_checkpoint(src, dst, dst_options=dst_options, progress=update)
                done.append(f"{label}: {src.uri} -> {out.uri} "
                            f"({plural(len(out.files), 'object')}, {size(out.total_size)})")
    finally:
        for line in done:
            print(line)
    return EXIT_OK


def cmd_cp(args: argparse.Namespace) -> int:
    return _copy([(open_checkpoint(args.src, args.options), args.dst)],
                 parse_options(args.dst_option) or args.options, "copy")


def cmd_download(args: argparse.Namespace) -> int:
    store = open_store(args.uri, args.options)
    if store.exists(MANIFEST_NAME):
        units = [("", open_checkpoint(store))]
    else:  # a root: every checkpoint below it, and each slot's current generation
        units = tree_units(store)
    code = _copy([(ckpt, str(Path(args.dir) / rel) if rel else args.dir)
                  for rel, ckpt in units], {}, "download")
    for rel, _ in units:
        _stock_metadata(str(Path(args.dir) / rel) if rel else args.dir)
    return code


def _stock_metadata(local: str) -> None:
    """A downloaded checkpoint's indexed DCP checkpoints get the ``.metadata`` torch's
    ``FileSystemReader`` reads."""
    if not any(f.rsplit("/", 1)[-1] == DCP_INDEX_NAME for f in open_checkpoint(local).files):
        return  # no DCP in the indexed format: nothing to import torch for
    from cloudckpt.dcp.stock import add_stock_metadata

    for uri in add_stock_metadata(open_checkpoint(local)):
        print(f"download: wrote {uri} for torch's own readers")


def cmd_dcp_stock(args: argparse.Namespace) -> int:
    import pickle

    from cloudckpt.dcp.stock import stock_metadata

    md = stock_metadata(args.uri, storage_options=args.options)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(pickle.dumps(md))
    tmp.replace(out)
    print(f"wrote {out}: {plural(len(md.state_dict_metadata), 'item')}, "
          f"{plural(len(md.storage_data or {}), 'chunk')}")
    return EXIT_OK


def cmd_rm(args: argparse.Namespace) -> int:
    store = open_store(args.uri, args.options)
    found = survey_prefix(store)
    if found.kind == COMMITTED:  # --force: even with a manifest that cannot be read
        stays = versioning.what_stays(store)
        n = delete_checkpoint(store, force=args.force)
        print(f"deleted {store.uri} ({_deleted(store, found, n, stays)}")
        return EXIT_OK
    if found.kind == OURS:
        if not args.force:
            raise incomplete(found)
        stays = versioning.what_stays(store)
        n = delete_unfinished(store, found)
        print(f"deleted the unfinished save at {store.uri} ({_deleted(store, found, n, stays)}")
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
    if not _confirm(args, f"delete these {plural(len(found.checkpoints), 'checkpoint')} "
                    "and any unfinished saves of cloudckpt's there?"):
        print("nothing deleted")
        return EXIT_OK
    stays = versioning.what_stays(store)
    deleted, n, before = delete_tree(store)
    print(f"deleted {plural(len(deleted), 'checkpoint or unfinished save')} below "
          f"{store.uri} ({_deleted(store, before, n, stays)}")
    if before.foreign:
        print(f"left {plural(len(before.foreign), 'object')} cloudckpt did not write, e.g. "
              f"{before.foreign[0]}")
    return EXIT_OK


def _deleted(store: Store, before: Survey, n: int, stays: str | None) -> str:
    """"12 objects, 3.1 MiB)", and what stays in a bucket keeping versions: the end of
    a delete's line, the bytes freed counted by one listing after it."""
    freed = before.size - survey_prefix(store).size
    return f"{plural(n, 'object')}, {size(freed)})" + (f"; {stays}" if stays else "")


def _confirm(args: argparse.Namespace, question: str) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise ConfigError(f"{question} Not asked: the input is not a terminal; pass --yes "
                          "to confirm")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def cmd_adopt(args: argparse.Namespace) -> int:
    from cloudckpt.dcp import adopt

    c = adopt(args.uri, args.options, step=args.step)
    print(f"adopted {c.uri}: {plural(len(c.files), 'object')} checked and committed")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from cloudckpt.core.gc import collect, find_garbage

    garbage = find_garbage(args.root, args.options, grace_seconds=args.grace)
    if not garbage:
        print(f"nothing to collect under {args.root} (grace {args.grace:.0f} s)")
        return EXIT_OK
    for g in garbage:
        print(f"{'remove' if args.yes else 'would remove'}  {g.uri}  ({g.reason}; "
              f"{plural(g.objects, 'object')}, {size(g.size)}, "
              f"{g.age_seconds / 3600:.1f} h old)")
    total = sum(g.objects for g in garbage)
    if args.yes:
        stays = versioning.what_stays(open_store(args.root, args.options))
        n = collect(garbage, args.options)
        print(f"removed {plural_prefix(len(garbage))} ({plural(n, 'object')})"
              + (f"; {stays}" if stays else ""))
    else:
        print(f"dry run: nothing deleted; --yes deletes {plural_prefix(len(garbage))} "
              f"({plural(total, 'object')})")
    return EXIT_OK


def cmd_push(args: argparse.Namespace) -> int:
    from cloudckpt.hf.hub import PushOptions, push

    options = PushOptions(revision=args.revision, private=True if args.private else None,
                          commit_message=args.message, create_pr=args.create_pr,
                          replace=args.replace, files_per_commit=args.files_per_commit,
                          progress=sys.stderr.isatty())
    done = push(args.uri, args.repo_id, options, token=args.token, endpoint=args.endpoint,
                storage_options=args.options)
    where = "same" if len(done.commits) < 2 else "last"
    for path in done.replaced:
        print(f"replaced {path} (deleted in the {where} commit: the export does not have it)")
    for url in done.commits:  # batches before the last (or all, under a pull request)
        if url != done.url:
            print(url)
    if not done.commits:
        print("the repo already holds this export: nothing committed")
    print(done.url)
    return EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    from cloudckpt.hf import convert

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
        print(f"converted {args.src} -> {out.uri} ({plural(len(out.files), 'file')})")
    else:
        n = convert.dcp_to_pt(args.dcp_path, args.output_path, key_prefix=args.key_prefix,
                              storage_options=args.options)
        print(f"wrote {plural(n, 'tensor')} to {args.output_path}")
    return EXIT_OK
