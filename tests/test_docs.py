"""The runnable examples in docs/ run as written."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).parent.parent / "docs"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_index_example_runs(capsys):
    blocks = [b for b in python_blocks(DOCS / "index.md") if "memory://" in b]
    assert blocks, "docs/index.md lost its runnable example"
    for block in blocks:
        exec(compile(block, "docs/index.md", "exec"), {})
    assert "memory://docs-example/run/step-1 1 ['model.pt']" in capsys.readouterr().out


def test_dcp_example_runs():
    blocks = [b for b in python_blocks(DOCS / "dcp.md") if "memory://" in b]
    assert blocks, "docs/dcp.md lost its runnable example"
    for block in blocks:
        exec(compile(block, "docs/dcp.md", "exec"), {})


def test_manager_example_runs():
    blocks = [b for b in python_blocks(DOCS / "manager.md") if "memory://" in b]
    assert blocks, "docs/manager.md lost its runnable example"
    for block in blocks:
        exec(compile(block, "docs/manager.md", "exec"), {})


def test_inspect_example_runs(capsys):
    blocks = [b for b in python_blocks(DOCS / "inspect.md") if "memory://" in b]
    assert blocks, "docs/inspect.md lost its runnable example"
    for block in blocks:
        exec(compile(block, "docs/inspect.md", "exec"), {})
    out = capsys.readouterr().out
    assert "{'model': {'tensors': 3, 'bytes': 192}}" in out
    assert "['model.layers.2.weight'] 0.5" in out and "2.5000" in out
