"""What every framework's one-key test checks: a run configured by only the
framework's own output key set to a bucket URI, under ``cloudckpt run -- <its usual
command>``, leaves the framework's code as it was and no file under the working
directory named for a scheme (``s3:``, ``gs:``: a bucket URI handed to local file calls);
and what each reads of its guide's recipe (its code blocks, its launch lines).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
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


#: A fenced code block: its fence's indentation, its language, its text.
_BLOCK = re.compile(r"^( *)```(\S*)\n(.*?)^\1```", re.S | re.M)


def _section(text: str, heading: str) -> str:
    """The text under the Markdown heading ``heading`` (its words, without the ``#``),
    to the next heading of its level or above; code blocks' ``#`` lines are no headings."""
    masked = _BLOCK.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    start = re.search(rf"^(#+) +{re.escape(heading)} *$", masked, re.M)
    assert start, f"the guide has no heading {heading!r}"
    end = re.compile(rf"^#{{1,{len(start.group(1))}}} ", re.M).search(masked, start.end())
    return text[start.end():end.start() if end else len(text)]


def guide_blocks(path: Path, lang: str | None = None, *, after: str | None = None
                 ) -> list[str]:
    """The code blocks of the guide ``path`` (of language ``lang``, or any; under the
    heading ``after``, or anywhere), their fence's indentation taken off."""
    text = path.read_text() if after is None else _section(path.read_text(), after)
    return [re.sub(rf"(?m)^{m.group(1)}", "", m.group(3)) for m in _BLOCK.finditer(text)
            if lang is None or m.group(2) == lang]


def guide_block(path: Path, lang: str, *, after: str | None = None,
                containing: str = "") -> str:
    """The first ``lang`` block of :func:`guide_blocks` that contains ``containing``."""
    found = [b for b in guide_blocks(path, lang, after=after) if containing in b]
    assert found, f"{path.name} has no {lang} block{f' under {after!r}' if after else ''} " \
        f"containing {containing!r}"
    return found[0]


def launch_lines(path: Path, *, after: str | None = None) -> list[list[str]]:
    """The words of each ``cloudckpt run -- ...`` line of the guide's code blocks (under
    the heading ``after``), a line continued by ``\\`` read whole."""
    lines = [shlex.split(line, comments=True)
             for block in guide_blocks(path, after=after)
             for line in block.replace("\\\n", " ").splitlines()
             if line.startswith("cloudckpt run ")]
    return [words for words in lines if words[:3] == ["cloudckpt", "run", "--"]]


def run_guide_script(script: str, cwd: Path, env: dict[str, str]) -> None:
    """A guide's shell block, run as written (``bash -e``) in ``cwd`` with this Python's
    commands (``cloudckpt``, ``hf``) first on ``PATH``, the Hub's test token and ``env``."""
    from helpers import HUB_TOKEN

    cwd.mkdir(parents=True, exist_ok=True)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    r = subprocess.run(["bash", "-ec", script], cwd=cwd, capture_output=True, text=True,
                       timeout=300, env={**os.environ, **env, "HF_TOKEN": HUB_TOKEN,
                                         "PATH": path})
    assert r.returncode == 0, (script, r.stdout[-2000:], r.stderr[-4000:])
