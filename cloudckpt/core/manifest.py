"""The manifest: the one object whose presence makes a checkpoint exist.

It lists every object of the checkpoint with its size and CRC32C, plus the
step, free-form metadata and a unique commit id. Readers take the file list
from here, never from a bucket listing. Paths are validated on load: relative,
POSIX, no ``..``, no scheme — a manifest can never point outside its prefix.

Manifests are read as hostile input: at most :data:`MAX_MANIFEST_BYTES` are
ever read (:func:`read_manifest_bytes`), the JSON must be UTF-8 without
duplicate keys, nesting too deep for the parser is refused, and every field is
type- and range-checked, so a bad manifest always ends in a
:class:`ManifestError` naming it, never in another exception.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cloudckpt.core import kinds
from cloudckpt.errors import ManifestError
from cloudckpt.names import (
    CLAIM_NAME,
    INTERNAL_MARKS,
    WRITER_AREAS,
)
from cloudckpt.names import MANIFEST_NAME as MANIFEST_NAME  # the manifest's name, exported

if TYPE_CHECKING:
    from cloudckpt.storage import Store

FORMAT = "cloudckpt.core.manifest"
VERSION = 1
#: Manifests larger than this are refused unread (bounded memory on hostile input).
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
#: A manifest is first read up to this many bytes: one request when it is smaller.
FIRST_READ = 1024 * 1024
#: Largest object size a manifest may state: 5 TiB, the most S3 and GCS store in one
#: object. (Unbounded sizes would make readers plan absurd numbers of ranged reads.)
MAX_OBJECT_SIZE = 5 * 1024**4
#: Steps are 64-bit signed integers, as every framework stores them.
_MAX_STEP = 2**63
#: Latest commit time a manifest may state: the end of year 9999 (UTC), the last
#: time every platform can show; earliest: the epoch.
MAX_CREATED = 253402300799.0
#: Most ranks a checkpoint's metadata may say saved it.
MAX_RANKS = 2**31 - 1
#: Longest ``kind`` or ``commit_id`` (cloudckpt's are a word and 32 hex digits).
_MAX_NAME = 256

_CRC_RE = re.compile(r"^[0-9a-f]{8}$")
#: A blob's name: the SHA-256 of its bytes, in hex.
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
#: A writer area's path below its prefix.
WRITER_AREA_RE = re.compile(rf"^{re.escape(WRITER_AREAS)}/[0-9a-f]{{32}}$")
#: Deepest a manifest may sit below the directory holding its blob area.
MAX_BLOB_DEPTH = 32
# C0 controls and DEL: no legitimate object name has them, and printed names must
# not be able to rewrite a terminal or forge log lines.
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class FileEntry:
    """One object of a checkpoint, stored at its path below the checkpoint's prefix
    unless ``blob``, the SHA-256 of its bytes, says it is stored in the run root's blob
    area under that name (an incremental save), or ``moved`` says it lies in the
    writer area the manifest names (a save that took the prefix over)."""

    size: int
    crc32c: str
    blob: str | None = None
    moved: bool = False

    @property
    def plain(self) -> FileEntry:
        """This entry as an object stored at its own path (a copy, a download)."""
        return FileEntry(self.size, self.crc32c) if self.blob or self.moved else self


@dataclass(frozen=True)
class Written:
    """An object a save wrote, as its checkpoint's manifest will list it: its path
    below the checkpoint and its entry. What every part, drain and uploader hands to
    the commit."""

    path: str
    entry: FileEntry


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's table of contents. Immutable once committed."""

    files: Mapping[str, FileEntry]
    step: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    kind: str = kinds.GENERIC
    created: float = field(default_factory=time.time)
    commit_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: How many levels above this manifest's prefix the directory holding the blob area
    #: lies (``cloudckpt-blobs/`` beside the run's checkpoints); set when any entry is a blob.
    blob_depth: int | None = None
    #: Where the ``moved`` objects lie: ``<writer_area>/<path>`` below the prefix
    #: ``writer_depth`` levels above this manifest's (``.cloudckpt-writers/<id>``),
    #: each at its path relative to that prefix; set when any entry is moved.
    writer_area: str | None = None
    writer_depth: int | None = None
    #: Keys below the prefix that the generation this commit replaced held and this one
    #: does not reference (``overwrite=True``): deleted after the swap, and listed so that
    #: a cleanup cut short is finished by whoever next replaces or deletes this checkpoint.
    superseded: tuple[str, ...] = ()

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.files.values())

    @property
    def blobs(self) -> dict[str, str]:
        """``{path: digest}`` of the objects stored in the blob area."""
        return {p: e.blob for p, e in self.files.items() if e.blob}

    @property
    def moved(self) -> list[str]:
        """The paths of the objects stored in the writer area."""
        return sorted(p for p, e in self.files.items() if e.moved)

    @property
    def live_keys(self) -> set[str]:
        """The keys below the prefix (writer area included) holding this commit's objects
        that lie there: every entry but the blobs, and those of a writer area above it."""
        area = self.writer_area if self.writer_depth == 0 else None
        return {f"{area}/{p}" if e.moved else p for p, e in self.files.items()
                if not e.blob and (area is not None or not e.moved)}

    @property
    def standard(self) -> bool:
        """Whether every object lies at its own path (no blob, nothing moved)."""
        return self.blob_depth is None and self.writer_area is None

    def materialized(self) -> Manifest:
        """The same commit with every object at its own path: what a copy or a
        download holds (the standard layout)."""
        if self.standard:
            return self
        return dataclasses.replace(self, files={p: e.plain for p, e in self.files.items()},
                                   blob_depth=None, writer_area=None, writer_depth=None,
                                   superseded=())

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "step": self.step,
            "created": self.created,
            "commit_id": self.commit_id,
            "metadata": dict(self.metadata),
            "files": {p: _entry_doc(e) for p, e in sorted(self.files.items())},
        }
        if self.blob_depth is not None:
            doc["blob_depth"] = self.blob_depth
        if self.writer_area is not None:
            doc["writer"] = {"area": self.writer_area, "depth": self.writer_depth}
        if self.superseded:
            doc["superseded"] = sorted(self.superseded)
        return json.dumps(doc, indent=1, sort_keys=False).encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str = "manifest") -> Manifest:
        """Parse and validate; raise :class:`ManifestError` saying what is wrong."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{source} is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit; "
                "it is not a cloudckpt manifest"
            )
        doc = _parse(data, source)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f"{source} is not a cloudckpt manifest (format field missing)")
        if doc.get("version") != VERSION:
            raise ManifestError(
                f"{source} has manifest version {_short(doc.get('version'))}; this cloudckpt "
                f"reads version {VERSION}. Upgrade cloudckpt."
            )
        files_doc = doc.get("files")
        if not isinstance(files_doc, dict):
            raise ManifestError(f"{source}: 'files' must be an object")
        files: dict[str, FileEntry] = {}
        for path, entry in files_doc.items():
            validate_path(path, source=source)
            if not isinstance(entry, dict):
                raise ManifestError(f"{source}: entry for {_short(path)} must be an object")
            crc = entry.get("crc32c")
            size = _bounded(entry.get("size"), "size", source, 0, MAX_OBJECT_SIZE,
                            of=f" for {_short(path)}")
            if not isinstance(crc, str) or not _CRC_RE.match(crc):
                raise ManifestError(f"{source}: bad crc32c {_short(crc)} for {_short(path)}")
            blob = entry.get("blob")
            if blob is not None and (not isinstance(blob, str) or not DIGEST_RE.match(blob)):
                raise ManifestError(f"{source}: bad blob digest {_short(blob)} for "
                                    f"{_short(path)}")
            moved = entry.get("moved", False)
            if not isinstance(moved, bool) or (moved and blob is not None):
                raise ManifestError(f"{source}: bad 'moved' {_short(moved)} for "
                                    f"{_short(path)}: true or false, and not for a blob")
            files[path] = FileEntry(size, crc, blob, moved)
        step = doc.get("step")
        if step is not None:
            step = _bounded(step, "step", source, -_MAX_STEP, _MAX_STEP - 1)
        metadata = doc.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ManifestError(f"{source}: 'metadata' must be an object")
        created = _created(doc.get("created"), source)
        kind, commit_id = doc.get("kind", kinds.GENERIC), doc.get("commit_id", "")
        for name, value in (("kind", kind), ("commit_id", commit_id)):
            if not isinstance(value, str) or _CONTROL_RE.search(value) \
                    or len(value) > _MAX_NAME:
                raise ManifestError(f"{source}: bad {name!r} {_short(value)}: it must be "
                                    f"text of at most {_MAX_NAME} characters. {_MALFORMED}")
        depth = doc.get("blob_depth")
        has_blobs = any(e.blob for e in files.values())
        if (depth is not None or has_blobs) and (
                not has_blobs or not isinstance(depth, int) or isinstance(depth, bool)
                or not 1 <= depth <= MAX_BLOB_DEPTH):
            raise ManifestError(f"{source}: bad blob_depth {_short(depth)}: it must be "
                                f"1 to {MAX_BLOB_DEPTH}, and given exactly when objects "
                                "are blobs")
        area, writer_depth = _writer_area(doc.get("writer"), files, source)
        manifest = cls(
            files=files,
            step=step,
            metadata=metadata,
            kind=kind,
            created=created,
            commit_id=commit_id,
            blob_depth=depth,
            writer_area=area,
            writer_depth=writer_depth,
        )
        return dataclasses.replace(manifest, superseded=_superseded(doc.get("superseded"),
                                                                    manifest, source))


_MALFORMED = ("The manifest is malformed, so the checkpoint cannot be trusted: fall back to "
              "an earlier one, or delete it (cloudckpt rm --force).")


def _bounded(value: Any, what: str, source: str, low: int, high: int, of: str = "") -> int:
    """``value``, a manifest's field, as an integer from ``low`` to ``high``;
    :class:`ManifestError` naming ``what`` (``of`` what) otherwise (a bool is no integer)."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ManifestError(f"{source}: bad {what} {_short(value)}{of}: it must be an "
                            f"integer from {low} to {high}. {_MALFORMED}")
    return value


def _created(value: Any, source: str) -> float:
    """The commit time: seconds since the epoch, up to the end of year 9999."""
    at = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            at = float(value)
        except OverflowError:
            pass
    if not 0 <= at <= MAX_CREATED:  # NaN fails this too
        raise ManifestError(f"{source}: bad 'created' time {_short(value)}: it must be "
                            f"seconds since 1970 up to {MAX_CREATED:.0f} (the end of year "
                            f"9999). {_MALFORMED}")
    return at


def metadata_int(manifest: Manifest, key: str, source: str, *, default: int, low: int,
                 high: int) -> int:
    """The integer a part or kind of checkpoint keeps under ``key`` of its manifest's
    metadata (``default`` when absent), from ``low`` to ``high``: any other value makes
    the manifest malformed (:class:`ManifestError`), like a bad field of its own."""
    return _bounded(manifest.metadata.get(key, default), f"metadata {key!r}", source, low,
                    high)


def _writer_area(doc: Any, files: Mapping[str, FileEntry], source: str
                 ) -> tuple[str | None, int | None]:
    """The validated ``writer`` field: given exactly when some entry is moved."""
    moved = any(e.moved for e in files.values())
    if doc is None and not moved:
        return None, None
    area = doc.get("area") if isinstance(doc, dict) else None
    depth = doc.get("depth") if isinstance(doc, dict) else None
    if (not moved or not isinstance(area, str) or not WRITER_AREA_RE.match(area)
            or not isinstance(depth, int) or isinstance(depth, bool)
            or not 0 <= depth <= MAX_BLOB_DEPTH):
        raise ManifestError(f"{source}: bad 'writer' {_short(doc)}: it must name the area "
                            f"({WRITER_AREAS}/<id>) and its depth (0 to {MAX_BLOB_DEPTH}), "
                            "and be given exactly when objects are moved")
    return area, depth


def _superseded(doc: Any, manifest: Manifest, source: str) -> tuple[str, ...]:
    """The validated ``superseded`` keys: paths below the prefix, none of them holding
    one of this commit's own objects."""
    if doc is None:
        return ()
    if not isinstance(doc, list):
        raise ManifestError(f"{source}: 'superseded' must be a list of paths. {_MALFORMED}")
    keys = tuple(validate_path(k, source=source) for k in doc)
    live = manifest.live_keys & set(keys)
    if live:
        raise ManifestError(f"{source}: 'superseded' names {_short(sorted(live)[0])}, which "
                            f"holds one of this checkpoint's own objects. {_MALFORMED}")
    return keys


def _entry_doc(entry: FileEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"size": entry.size, "crc32c": entry.crc32c}
    if entry.blob:
        doc["blob"] = entry.blob
    if entry.moved:
        doc["moved"] = True
    return doc


def validate_path(path: Any, *, source: str = "manifest") -> str:
    """A checkpoint-relative object path: no scheme, not absolute, no ``..``."""
    bad = None
    if not isinstance(path, str) or not path:
        bad = "not a non-empty string"
    elif "://" in path or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", path):
        bad = "has a URL scheme"
    elif path.startswith("/") or path.startswith("\\"):
        bad = "is absolute"
    elif "\\" in path or "\x00" in path:
        bad = "contains a backslash or NUL"
    elif _CONTROL_RE.search(path):
        bad = "contains a control character"
    elif not _utf8(path):
        bad = "is not valid Unicode (a lone surrogate)"
    elif any(p in ("", ".", "..") for p in path.split("/")):
        bad = "has an empty, '.' or '..' component"
    elif path == MANIFEST_NAME:
        bad = "is the manifest itself"
    elif path.rsplit("/", 1)[-1] == CLAIM_NAME or any(m in path for m in INTERNAL_MARKS):
        bad = "is a name cloudckpt reserves for its own bookkeeping"
    if bad:
        raise ManifestError(
            f"{source} names object {_short(path)}, which {bad}; objects must be relative paths "
            "inside the checkpoint. The manifest is malformed or hostile; do not load it."
        )
    assert isinstance(path, str)  # else bad, above
    return path


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(value: Any) -> str:
    """``repr`` cut short: hostile values must not flood a message."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(ValueError):
    pass


def _parse(data: bytes, source: str) -> Any:
    """JSON from manifest bytes; every failure is a :class:`ManifestError` naming ``source``."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{source} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                            "it is not a cloudckpt manifest") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise ManifestError(f"{source} names key {_short(exc.args[0])} twice; a manifest "
                            "that can be read two ways cannot be trusted") from None
    except RecursionError:
        raise ManifestError(f"{source} nests JSON too deeply to read; it is not a cloudckpt "
                            "manifest") from None
    except ValueError as exc:
        raise ManifestError(f"{source} is not valid JSON ({str(exc)[:200]}); the checkpoint "
                            "cannot be trusted") from None


def read_manifest_bytes(store: Store, key: str = MANIFEST_NAME, *,
                        limit: int = MAX_MANIFEST_BYTES, size: int | None = None) -> bytes:
    """The bytes of the manifest ``key`` of ``store``, never reading more than ``limit``.

    ``size``, where the caller already knows it (the run root's index records each
    manifest's), makes it one request of any size: over ``limit`` it is refused unread,
    else that many bytes and one more are asked for, and an object that turns out
    bigger (replaced since the size was taken) is read as one of unknown size.

    Otherwise one request for a manifest under :data:`FIRST_READ` (nearly all of them): a
    bounded read that returns the whole object. A bigger one is sized first: when
    the store reports the object's size, a manifest over ``limit`` is refused
    unread and exactly that size is read (an object replaced meanwhile by a bigger one
    is still cut there). When it cannot (no size, or 0), a one-byte read at offset
    ``limit`` tells whether it is over, and then at most ``limit + 1`` bytes are read.
    Raises :class:`ManifestError` when over the limit and ``FileNotFoundError`` when
    there is no such object.
    """
    uri = store.key_uri(key)
    if size is not None:
        if size > limit:
            raise ManifestError(f"{uri} is {size} bytes, over the {limit} limit; refusing "
                                "to read it: it is not a cloudckpt manifest")
        whole = store.get_upto(key, 0, size + 1)
        if len(whole) <= size:
            return whole
        del whole
    first = store.get_upto(key, 0, min(FIRST_READ, limit + 1))
    if len(first) < FIRST_READ:
        if len(first) > limit:
            raise ManifestError(f"{uri} is over the {limit} byte limit; refusing to read it: "
                                "it is not a cloudckpt manifest")
        return first  # the whole object
    del first
    info = store.info(key)
    if info is not None and info.size > limit:
        raise ManifestError(f"{uri} is {info.size} bytes, over the {limit} limit; refusing "
                            "to read it: it is not a cloudckpt manifest")
    if info is not None and info.size > 0:
        try:
            return store.get_range(key, 0, info.size)
        except EOFError:
            raise ManifestError(f"{uri} shrank while it was read; it is being replaced, "
                                "which a committed manifest never is") from None
    if store.get_upto(key, limit, limit + 1):  # a byte past the limit: refuse unread
        raise ManifestError(f"{uri} is over the {limit} byte limit; refusing to read it: it "
                            "is not a cloudckpt manifest")
    data = store.get_upto(key, 0, limit + 1)
    if len(data) > limit:  # it grew meanwhile
        raise ManifestError(f"{uri} is over the {limit} byte limit; refusing to read it: it "
                            "is not a cloudckpt manifest")
    return data
