"""The manifest: the one object whose presence makes a checkpoint exist.

It lists every object of the checkpoint with its size and CRC32C, plus the
step, free-form metadata and a unique commit id. Readers take the file list
from here, never from a bucket listing. Paths are validated on load: relative,
POSIX, no ``..``, no scheme — a manifest can never point outside its prefix.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ManifestError

#: The manifest's fixed key inside every checkpoint prefix.
MANIFEST_NAME = "cloudckpt-manifest.json"
FORMAT = "cloudckpt.manifest"
VERSION = 1
#: Manifests larger than this are refused unread (bounded memory on hostile input).
MAX_MANIFEST_BYTES = 64 * 1024 * 1024

_CRC_RE = re.compile(r"^[0-9a-f]{8}$")


@dataclass(frozen=True)
class FileEntry:
    """One object of a checkpoint."""

    size: int
    crc32c: str


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's table of contents. Immutable once committed."""

    files: Mapping[str, FileEntry]
    step: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "generic"
    created: float = field(default_factory=time.time)
    commit_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.files.values())

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "step": self.step,
            "created": self.created,
            "commit_id": self.commit_id,
            "metadata": dict(self.metadata),
            "files": {
                p: {"size": e.size, "crc32c": e.crc32c} for p, e in sorted(self.files.items())
            },
        }
        return json.dumps(doc, indent=1, sort_keys=False).encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str = "manifest") -> Manifest:
        """Parse and validate; raise :class:`ManifestError` saying what is wrong."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{source} is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit; "
                "it is not a cloudckpt manifest"
            )
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{source} is not valid JSON ({exc}); the checkpoint "
                                "cannot be trusted") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f"{source} is not a cloudckpt manifest (format field missing)")
        if doc.get("version") != VERSION:
            raise ManifestError(
                f"{source} has manifest version {doc.get('version')!r}; this cloudckpt "
                f"reads version {VERSION}. Upgrade cloudckpt."
            )
        files_doc = doc.get("files")
        if not isinstance(files_doc, dict):
            raise ManifestError(f"{source}: 'files' must be an object")
        files: dict[str, FileEntry] = {}
        for path, entry in files_doc.items():
            validate_path(path, source=source)
            if not isinstance(entry, dict):
                raise ManifestError(f"{source}: entry for {path!r} must be an object")
            size, crc = entry.get("size"), entry.get("crc32c")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ManifestError(f"{source}: bad size {size!r} for {path!r}")
            if not isinstance(crc, str) or not _CRC_RE.match(crc):
                raise ManifestError(f"{source}: bad crc32c {crc!r} for {path!r}")
            files[path] = FileEntry(size, crc)
        step = doc.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise ManifestError(f"{source}: bad step {step!r}")
        metadata = doc.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ManifestError(f"{source}: 'metadata' must be an object")
        created = doc.get("created")
        if not isinstance(created, (int, float)):
            raise ManifestError(f"{source}: bad 'created' time {created!r}")
        return cls(
            files=files,
            step=step,
            metadata=metadata,
            kind=str(doc.get("kind", "generic")),
            created=float(created),
            commit_id=str(doc.get("commit_id", "")),
        )


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
    elif any(p in ("", ".", "..") for p in path.split("/")):
        bad = "has an empty, '.' or '..' component"
    elif path == MANIFEST_NAME:
        bad = "is the manifest itself"
    if bad:
        raise ManifestError(
            f"{source} names object {path!r}, which {bad}; objects must be relative paths "
            "inside the checkpoint. The manifest is malformed or hostile; do not load it."
        )
    return path
