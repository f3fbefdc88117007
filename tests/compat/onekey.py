"""What every framework's one-key test checks: a run configured by only the
framework's own output key set to a bucket URI, under ``cloudckpt run -- <its usual
command>``, leaves the framework's code as it was and no file under the working
directory named for a scheme (``s3:``, ``gs:``: a bucket URI handed to local file calls).
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SCHEMES = ("s3:", "gs:", "gcs:", "az:", "abfs:", "memory:", "file:")


def package_dir(name: str) -> Path:
    """Where the package ``name`` (``verl``, ``areal``, ``roll``) is imported from."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not importable"
    return Path(next(iter(spec.submodule_search_locations)))


def code_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file below ``root`` (caches aside)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@contextmanager
def unchanged(*packages: str) -> Iterator[None]:
    """Assert that the files of ``packages`` hash the same after the block."""
    roots = [package_dir(name) for name in packages]
    before = [code_hashes(root) for root in roots]
    yield
    for name, root, was in zip(packages, roots, before, strict=True):
        now = code_hashes(root)
        changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
        assert not changed, f"{name}'s files changed: {changed[:10]}"


def scheme_named(cwd: Path) -> list[str]:
    """Every path below ``cwd`` one of whose parts starts with a scheme."""
    return sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*")
                  if any(part.startswith(SCHEMES) for part in p.relative_to(cwd).parts))
