"""``cloudckpt inspect`` and ``cloudckpt diff``: what checkpoints hold and how two
differ, printed from their metadata (:mod:`cloudckpt.contents`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cloudckpt.cli.output import plural, size
from cloudckpt.errors import EXIT_OK
from cloudckpt.util.cliargs import COMMAND, add_command

__all__ = ["add_contents", "cmd_diff", "cmd_inspect"]

#: Exit status of ``diff --exit-code`` when the checkpoints differ (as ``git diff``'s).
EXIT_DIFFERENT = 1


def add_contents(sub: Any) -> None:
    """The ``inspect`` and ``diff`` commands."""
    sp = add_command(sub, "inspect", cmd_inspect, "list a checkpoint's tensors (shape, dtype, "
                     "bytes, shards) and totals per top-level key, from its metadata alone",
                     level=COMMAND)
    sp.add_argument("uri", help="a committed checkpoint: DCP, training, HF export or a "
                    "framework's layout")
    sp.add_argument("names", nargs="*", metavar="GLOB",
                    help="only the tensors (and files) whose name matches, e.g. 'model.*'")
    sp.add_argument("--json", action="store_true", help="print the listing as JSON")
    sp = add_command(sub, "diff", cmd_diff, "what changed from checkpoint A to B: tensors "
                     "added, removed, retyped or changed (by the manifests' checksums: no "
                     "tensor bytes read)", level=COMMAND)
    sp.add_argument("a", help="the first checkpoint")
    sp.add_argument("b", help="the second checkpoint")
    sp.add_argument("names", nargs="*", metavar="GLOB", help="only the tensors matching")
    sp.add_argument("--values", action="store_true",
                    help="also read the changed tensors (only those) and print their largest "
                    "absolute and relative differences")
    sp.add_argument("--json", action="store_true", help="print the differences as JSON")
    sp.add_argument("--exit-code", action="store_true",
                    help="exit 1 when the checkpoints differ (as git diff --exit-code)")


def _shape(shape: Any) -> str:
    return "-" if shape is None else f"[{', '.join(str(d) for d in shape)}]"


def cmd_inspect(args: argparse.Namespace) -> int:
    from cloudckpt.contents.inventory import list_contents

    c = list_contents(args.uri, args.options).matching(args.names)
    if args.json:
        print(json.dumps(c.to_json(), indent=2))
        return EXIT_OK
    print(f"uri:     {c.uri}\nkind:    {c.kind}\nstep:    {c.step}\n"
          f"size:    {size(c.total_bytes)}; {plural(len(c.entries), 'tensor')}"
          + (f" matching {' '.join(args.names)}" if args.names else ""))
    if c.entries:
        width = max(len(e.key) for e in c.entries)
        print(f"\n  {'NAME':<{width}}  {'DTYPE':<10} {'SHAPE':<20} {'BYTES':>10}  SHARDS")
        for e in c.entries:
            print(f"  {e.key:<{width}}  {e.dtype or '(value)':<10} {_shape(e.shape):<20} "
                  f"{size(e.nbytes):>10}  {e.shards}")
        print("\ntotals:")
        for group, t in c.totals().items():
            print(f"  {group:<24} {plural(t['tensors'], 'tensor'):>14}  {size(t['bytes']):>10}")
    if c.others:
        print("\nother files:")
        for f in c.others:
            print(f"  {f.path}  {size(f.nbytes)}")
    for problem in c.problems:
        print(f"\nPROBLEM: {problem}")
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    from cloudckpt.contents.compare import diff

    d = diff(args.a, args.b, storage_options=args.options, patterns=args.names,
             values=args.values)
    if args.json:
        print(json.dumps(d.to_json(), indent=2))
        return _status(args, d.same)
    for e in d.added:
        print(f"+ {e.key}  {e.dtype or '(value)'} {_shape(e.shape)}")
    for e in d.removed:
        print(f"- {e.key}  {e.dtype or '(value)'} {_shape(e.shape)}")
    for a, b in d.retyped:
        print(f"~ {b.key}  {a.dtype} {_shape(a.shape)} -> {b.dtype} {_shape(b.shape)}")
    for _, b in d.changed:
        v = d.values.get(b.key)
        print(f"M {b.key}" + (f"  max abs {v.max_abs:.6g}, max rel {v.max_rel:.6g}" if v else ""))
    for _, b in d.unknown:
        print(f"? {b.key}  (in files that differ; --values reads it to tell)")
    for label, paths in (("changed", d.files_changed), ("added", d.files_added),
                         ("removed", d.files_removed)):
        for p in paths:
            print(f"file {label}: {p}")
    print(f"{plural(len(d.added), 'tensor')} added, {len(d.removed)} removed, "
          f"{len(d.retyped)} retyped, {len(d.changed)} changed, {len(d.unknown)} unknown, "
          f"{len(d.unchanged)} unchanged"
          + f"; {plural(len(d.files_changed), 'file')} changed")
    return _status(args, d.same)


def _status(args: argparse.Namespace, same: bool) -> int:
    return EXIT_DIFFERENT if args.exit_code and not same else EXIT_OK
