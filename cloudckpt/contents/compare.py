"""How two committed checkpoints differ, from their metadata; with ``values``, by how much.

Tensors are matched by name (after their part's directory). A pair whose dtype and
shape agree is compared by the checksums the manifests already hold, a CRC32C per
DCP item or per exported tensor, so no tensor byte is read; where only the files'
checksums are known (exports and framework layouts written by other tools), a pair
in identical files is unchanged and one in files that differ is *unknown*, and the
files are named. ``values=True`` reads only the changed and unknown tensors, a
bounded batch at a time, and gives each its largest absolute and relative
difference (relative to B's largest magnitude). DCP items without item checksums
(a DCP checkpoint another tool wrote) cannot be read alone and checked, so they
stay unknown.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cloudckpt.contents.inventory import Contents, Entry, list_contents
from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint

if TYPE_CHECKING:
    import torch

__all__ = ["Diff", "ValueDiff", "diff"]

#: Bytes of tensors held at once from each side while ``values`` compares them.
VALUES_BATCH = 256 * 1024 * 1024


@dataclass(frozen=True)
class ValueDiff:
    """The largest element-wise differences of one tensor pair."""

    max_abs: float
    max_rel: float


@dataclass
class Diff:
    """Tensors added, removed, retyped (dtype or shape), changed, unknown and unchanged
    from A to B; files (other than tensor data) that differ; and, when asked, values."""

    a: Contents
    b: Contents
    added: list[Entry] = field(default_factory=list)
    removed: list[Entry] = field(default_factory=list)
    retyped: list[tuple[Entry, Entry]] = field(default_factory=list)
    changed: list[tuple[Entry, Entry]] = field(default_factory=list)
    unknown: list[tuple[Entry, Entry]] = field(default_factory=list)
    unchanged: list[tuple[Entry, Entry]] = field(default_factory=list)
    files_changed: list[str] = field(default_factory=list)
    files_added: list[str] = field(default_factory=list)
    files_removed: list[str] = field(default_factory=list)
    values: dict[str, ValueDiff] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        return not (self.added or self.removed or self.retyped or self.changed
                    or self.unknown or self.files_changed or self.files_added
                    or self.files_removed)

    def unknown_files(self) -> list[str]:
        """The files of A and B holding the unknown tensors: they differ."""
        return sorted({f for a, b in self.unknown for f in (*a.files, *b.files)})

    def to_json(self) -> dict[str, Any]:
        def pair(a: Entry, b: Entry) -> dict[str, Any]:
            out: dict[str, Any] = {"name": b.key, "a": _typed(a), "b": _typed(b)}
            if b.key in self.values:
                v = self.values[b.key]
                out.update(max_abs=v.max_abs, max_rel=v.max_rel)
            return out

        return {"a": self.a.uri, "b": self.b.uri, "same": self.same,
                "added": [e.to_json() for e in self.added],
                "removed": [e.to_json() for e in self.removed],
                "retyped": [pair(a, b) for a, b in self.retyped],
                "changed": [pair(a, b) for a, b in self.changed],
                "unknown": [pair(a, b) for a, b in self.unknown],
                "unchanged": len(self.unchanged),
                "files": {"changed": self.files_changed, "added": self.files_added,
                          "removed": self.files_removed,
                          "holding_unknown": self.unknown_files()}}


def _typed(e: Entry) -> dict[str, Any]:
    return {"dtype": e.dtype, "shape": None if e.shape is None else list(e.shape),
            "bytes": e.nbytes}


def diff(a: str | Checkpoint, b: str | Checkpoint, *,
         storage_options: Mapping[str, Any] | None = None,
         b_storage_options: Mapping[str, Any] | None = None,
         patterns: Sequence[str] = (), values: bool = False) -> Diff:
    """How the committed checkpoint ``b`` differs from ``a`` (see the module's doc);
    ``patterns`` (globs on tensor names) limits it to some tensors."""
    ca = a if isinstance(a, Checkpoint) else open_checkpoint(a, storage_options)
    cb = b if isinstance(b, Checkpoint) else open_checkpoint(
        b, storage_options if b_storage_options is None else b_storage_options)
    la = list_contents(ca).matching(patterns)
    lb = list_contents(cb).matching(patterns)
    out = Diff(la, lb)
    ea = {e.key: e for e in la.entries}
    eb = {e.key: e for e in lb.entries}
    out.added = [eb[k] for k in sorted(eb.keys() - ea.keys())]
    out.removed = [ea[k] for k in sorted(ea.keys() - eb.keys())]
    for key in sorted(ea.keys() & eb.keys()):
        x, y = ea[key], eb[key]
        verdict = _compare(x, y, la.file_crcs, lb.file_crcs)
        {"retyped": out.retyped, "changed": out.changed, "unknown": out.unknown,
         "unchanged": out.unchanged}[verdict].append((x, y))
    fa = {f.path: f.crc32c for f in la.others}
    fb = {f.path: f.crc32c for f in lb.others}
    out.files_added = sorted(fb.keys() - fa.keys())
    out.files_removed = sorted(fa.keys() - fb.keys())
    out.files_changed = sorted(p for p in fa.keys() & fb.keys() if fa[p] != fb[p])
    if values:
        _values(out, ca, cb)
    return out


def _compare(x: Entry, y: Entry, crcs_a: Mapping[str, str], crcs_b: Mapping[str, str]) -> str:
    if (x.format, x.dtype, x.shape) != (y.format, y.dtype, y.shape):
        return "retyped"
    if x.checksums is not None and y.checksums is not None and _layout(x) == _layout(y):
        return "unchanged" if x.checksums == y.checksums else "changed"
    if x.files == y.files and all(crcs_a.get(f) == crcs_b.get(f) for f in x.files):
        return "unchanged"  # the same bytes hold it on both sides
    return "unknown"


def _layout(e: Entry) -> tuple[str, ...]:
    """Where each of an entry's checksums starts (its chunks' offsets)."""
    return tuple(where for where, _ in e.checksums or ())


def _values(out: Diff, ca: Checkpoint, cb: Checkpoint) -> None:
    """Read the changed and unknown tensor pairs and record their differences; an
    unknown pair turns out changed or unchanged."""
    import torch

    pairs = [(x, y) for x, y in (*out.changed, *out.unknown) if _readable(x) and _readable(y)]
    settled: dict[str, bool] = {}
    for batch in _batches(pairs):
        ta = read_tensors(ca, [x for x, _ in batch])
        tb = read_tensors(cb, [y for _, y in batch])
        for x, y in batch:
            u, v = ta.pop(x.key), tb.pop(y.key)
            out.values[y.key] = _difference(u, v)
            settled[y.key] = bool(torch.equal(u, v))
    unknown, out.unknown = out.unknown, []
    for x, y in unknown:
        if y.key not in settled:
            out.unknown.append((x, y))
        else:
            (out.unchanged if settled[y.key] else out.changed).append((x, y))
            if settled[y.key]:
                out.values.pop(y.key, None)
    out.changed.sort(key=lambda p: p[1].key)


def _readable(e: Entry) -> bool:
    """Whether a verified read of the entry alone is possible: a tensor of a safetensors
    file, or a DCP tensor with its item checksums (a DCP checkpoint another tool wrote
    has only per-file checksums, which a read of one item cannot check)."""
    return e.format == "safetensors" or (e.format == "dcp" and e.checksums is not None)


def _batches(pairs: Sequence[tuple[Entry, Entry]]) -> Iterator[list[tuple[Entry, Entry]]]:
    batch: list[tuple[Entry, Entry]] = []
    size = 0
    for pair in pairs:
        if batch and size + pair[0].nbytes > VALUES_BATCH:
            yield batch
            batch, size = [], 0
        batch.append(pair)
        size += pair[0].nbytes
    if batch:
        yield batch


def _difference(u: torch.Tensor, v: torch.Tensor) -> ValueDiff:
    import torch

    if u.numel() == 0:
        return ValueDiff(0.0, 0.0)
    wide = torch.complex128 if u.is_complex() or v.is_complex() else torch.float64
    delta = float((u.to(wide) - v.to(wide)).abs().max().item())
    scale = float(v.to(wide).abs().max().item())
    return ValueDiff(delta, delta / scale if scale else (0.0 if delta == 0 else float("inf")))


def read_tensors(ckpt: Checkpoint, entries: Iterable[Entry]) -> dict[str, torch.Tensor]:
    """The tensors of ``entries`` (listed from ``ckpt``), reading only their bytes: DCP
    items through a partial :func:`cloudckpt.dcp.load` of their part, safetensors
    tensors by the byte ranges their headers give. Keyed by :attr:`Entry.key`."""
    import torch

    from cloudckpt.dcp.api import load
    from cloudckpt.hf.lazy import ExportReader

    by_part: dict[tuple[str, str], list[Entry]] = defaultdict(list)
    for e in entries:
        by_part[(e.format, e.part)].append(e)
    out: dict[str, torch.Tensor] = {}
    for (fmt, part), group in by_part.items():
        if fmt == "safetensors":
            reader = ExportReader(ckpt, sorted({f for e in group for f in e.files}))
            got = reader.get_tensors([e.name for e in group])
            out.update((e.key, got[e.name]) for e in group)
        else:
            state = {e.name: torch.empty(e.shape or (), dtype=getattr(torch, e.dtype or ""))
                     for e in group}
            load(state, open_checkpoint(ckpt.store.child(part)).store if part else ckpt.store)
            out.update((e.key, state[e.name]) for e in group)
    return out
