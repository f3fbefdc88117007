"""The structural rules of the package, checked so that they stay true: module
size, no framework knowledge in the core, one home for unpickling, and layers
that import only downwards (import-linter, as ``make lint`` runs it)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import docstring_ids

PACKAGE = Path(__file__).resolve().parent.parent / "cloudckpt"
MAX_MODULE_LINES = 450
FRAMEWORK_WORDS = re.compile(
    r"\b(actor|critic|rlinf|roll|areal|verl|global_step|recover_checkpoint)\b", re.IGNORECASE)
#: Where framework names belong: the integrations and the CLI's framework subcommands.
FRAMEWORK_HOMES = ("integrations",)
#: The one home of every ``torch.load`` call and ``pickle.Unpickler`` subclass.
UNPICKLING_HOME = "serialization"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _in(path: Path, top: str) -> bool:
    return path.relative_to(PACKAGE).parts[0] == top


def framework_strings(path: Path) -> list[str]:
    """The string literals of ``path`` (not docstrings) that name a framework."""
    tree = ast.parse(path.read_text())
    docs = docstring_ids(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docs and FRAMEWORK_WORDS.search(node.value)):
            found.append(f"{_rel(path)}:{node.lineno}: {node.value[:60]!r}")
    return found


def unpickling_sites(path: Path) -> list[str]:
    """``torch.load`` calls and ``pickle.Unpickler`` subclasses in ``path``."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load" and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"):
            found.append(f"{_rel(path)}:{node.lineno}: torch.load")
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if ast.unparse(base).endswith("Unpickler"):
                    found.append(f"{_rel(path)}:{node.lineno}: class {node.name}")
    return found


def test_modules_are_small():
    big = [f"{_rel(p)}: {n} lines" for p in _modules()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them): {big}"


def test_the_core_names_no_framework():
    leaks = [s for p in _modules() if not any(_in(p, h) for h in FRAMEWORK_HOMES)
             for s in framework_strings(p)]
    assert not leaks, ("framework names in string literals outside integrations/ "
                       f"(register them through cloudckpt.core.plugins instead): {leaks}")


def test_only_integrations_and_the_cli_import_integrations():
    bad = []
    for p in _modules():
        if _in(p, "integrations") or _in(p, "cli"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{_rel(p)}:{node.lineno}" for n in names
                    if n.startswith("cloudckpt.integrations")]
    assert not bad, f"the core imports the integrations: {bad}"


def test_unpickling_has_one_home():
    outside = [s for p in _modules() if not _in(p, UNPICKLING_HOME) for s in unpickling_sites(p)]
    assert not outside, f"torch.load / Unpickler outside cloudckpt/{UNPICKLING_HOME}: {outside}"


@pytest.mark.parametrize("probe", [
    "storage", "core", "dcp", "training"])
def test_an_upward_import_fails_the_layer_check(tmp_path, probe):
    """lint-imports, run as `make lint` runs it, rejects a module of a lower layer
    importing the CLI (the top): the contract is live, not decorative. The probe goes
    into a copy of the package, found first on PYTHONPATH: tests running beside this
    one list and import the real package."""
    shutil.copytree(PACKAGE, tmp_path / "cloudckpt",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PACKAGE.parent / "pyproject.toml", tmp_path)
    (tmp_path / "cloudckpt" / probe / "_upward_probe.py").write_text(
        "import cloudckpt.cli  # noqa: F401\n")
    out = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
                         cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode != 0, out.stdout[-2000:]
    assert f"cloudckpt.{probe}._upward_probe -> cloudckpt.cli" in out.stdout, out.stdout[-2000:]


def test_the_wheel_ships_the_library_not_the_test_rigs(tmp_path):
    """`pip wheel .` holds cloudckpt's package only: no fault proxy, Hub emulator,
    thread ranks or counting store (they are the test kit's, in testkit/)."""
    root = PACKAGE.parent
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "cloudckpt", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("cloudckpt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "cloudckpt/core/manifest.py" in names  # the library is there
    rigs = [n for n in names if re.search(
        r"testkit|testing|faultproxy|hubserver|threadranks|counting", n)]
    assert not rigs, rigs
