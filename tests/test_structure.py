"""The structural rules of the package, checked so that they stay true: no private
name used across modules, module sizes reported (and capped generously), no
framework knowledge in the core, one home for unpickling, and layers that import
only downwards (import-linter, as ``make lint`` runs it)."""

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
TESTKIT = PACKAGE.parent / "testkit" / "cloudckpt_testkit"
#: A module is as long as what it holds needs; past this it holds too much.
MAX_MODULE_LINES = 1200
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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_from(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` in module ``here`` names."""
    if not node.level:
        return node.module or ""
    base = here.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(path: Path, root: Path) -> list[str]:
    """Private names (one leading underscore) that ``path`` takes from another module of
    the package under ``root``: imported by name (``from cloudckpt.dcp.placement import
    _plan``), or reached as an attribute of a module it imported (``placement._plan``).
    A private module (the test kit's ``_lifecycle``) is its package's: its siblings
    import its public names."""
    top = root.name
    here = _module_name(path, root)
    where = path.relative_to(root.parent).as_posix()
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}  # the names bound to the package's modules in ``path``
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == top:
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _imported_from(node, here, path.name == "__init__.py")
            if source.split(".")[0] != top:
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}:{node.lineno}: {alias.name} (from {source})")
                else:
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            holder = ast.unparse(node.value)
            if holder in modules:
                found.append(f"{where}:{node.lineno}: {node.attr} (of {modules[holder]})")
    return found


@pytest.mark.parametrize("root", [PACKAGE, TESTKIT], ids=["cloudckpt", "testkit"])
def test_no_private_name_is_used_across_modules(root):
    """A name with a leading underscore belongs to its module: one another module needs
    is part of an interface, and is named (and documented) as one."""
    found = [use for p in sorted(root.rglob("*.py")) for use in private_uses(p, root)]
    assert not found, ("private names used outside their module (make them public, in "
                       "a module named for what they hold, or merge the modules):\n"
                       + "\n".join(found))


def test_the_private_name_scan_sees_every_shape(tmp_path):
    """The scan is live: each way of reaching another module's private name is reported
    (by name, through a module bound by ``import``, ``import ... as`` or ``from``, and by
    a relative import), and what is not one (a dunder, a public name imported under a
    private alias, a module's own private names) is not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from ._inner import _hidden\n")
    (pkg / "sub" / "_inner.py").write_text("_hidden = 1\n")
    (pkg / "a.py").write_text("_x = _y = _z = _w = 1\n__version__ = '1'\nshared = 2\n"
                              "def f():\n    return _x\n")
    (pkg / "b.py").write_text(
        "import pkg.a\nimport pkg.a as m\nfrom pkg import a\n"
        "from pkg.a import _x, __version__, shared as _shared\nfrom .a import _y\n"
        "print(a._z, m._w, pkg.a._x, a.__version__, _shared)\n")
    found = [use.split(": ", 1)[1] for p in sorted(pkg.rglob("*.py"))
             for use in private_uses(p, pkg)]
    assert sorted(found) == sorted([
        "_hidden (from pkg.sub._inner)", "_x (from pkg.a)", "_y (from pkg.a)",
        "_z (of pkg.a)", "_w (of pkg.a)", "_x (of pkg.a)"]), found


@pytest.mark.parametrize("root", [PACKAGE, TESTKIT], ids=["cloudckpt", "testkit"])
def test_module_sizes(root):
    """Modules are sized by what they hold; the largest are reported (``-s`` shows them)
    and a module past the generous cap fails."""
    sizes = sorted(((len(p.read_text().splitlines()), p.relative_to(root.parent).as_posix())
                    for p in root.rglob("*.py")), reverse=True)
    print(f"\nlargest modules of {root.name}:", *(f"{n:5d} {p}" for n, p in sizes[:10]),
          sep="\n  ")
    big = [f"{p}: {n} lines" for n, p in sizes if n > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines (they hold too much): {big}"


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
