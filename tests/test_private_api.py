"""Private internals of other packages: used only through ``cloudckpt/compat/``, and
each one declared there still exists on the installed versions.

The scan reads every module of cloudckpt outside ``compat/`` and reports, by file and
line: an import of an underscore name or module of another package; an underscore
attribute reached from one (``torch._utils``, ``argparse._SubParsersAction``); an
underscore attribute of an fsspec filesystem (cloudckpt's ``fs``), of what a call
returned, or that cloudckpt itself never defines (so not its own object's); the same
through ``getattr`` and its kin with a literal name; a string naming one (``"torch._utils"``,
or a pickle global ``("torch.serialization", "_get_layout")``); a class overriding an
underscore member of another package's base class. What it cannot see is a private
attribute of another package's object that has the name of one of cloudckpt's own
(``x._call`` on an object of unknown type): that is what review is for.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import docstring_ids

from cloudckpt import compat

PACKAGE = Path(compat.__file__).resolve().parent.parent
COMPAT = Path(compat.__file__).resolve().parent

#: Underscore names that are documented, public API.
DOCUMENTED = {"os._exit"}

#: Private members of a framework's own objects that its integration calls, by file and
#: name. Frameworks are not cloudckpt's dependencies: an integration binds only the
#: versions it was tested with (activation refuses others), and tests/compat runs it
#: against them.
FRAMEWORK_INTERNALS = {
    ("integrations/verl/workers.py", "_backfill_optimizer_state"):
        "verl's FSDP checkpoint manager completing a loaded optimizer state, as its own "
        "load_checkpoint does",
    ("integrations/verl/profile.py", "_has_lora"):
        "verl's FSDP checkpoint manager telling a LoRA-only save (its own save_checkpoint's "
        "rule), recorded as the part's save profile",
}

#: The names by which cloudckpt holds an fsspec filesystem (a backend's ``self.fs``).
FILESYSTEM_HOLDERS = {"fs"}

_GETATTR_KIN = {"getattr", "hasattr", "setattr", "delattr"}
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.\w+)+")


@dataclass(frozen=True)
class Use:
    """A private internal used at ``path:line`` (``path`` relative to the package)."""

    path: str
    line: int
    name: str  # the underscore name
    what: str

    def __str__(self) -> str:
        return f"cloudckpt/{self.path}:{self.line}: {self.what}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _first_private(dotted: str) -> str | None:
    return next((part for part in dotted.split(".") if _private(part)), None)


def _external(module: str) -> bool:
    """Whether ``module`` is another package's (the standard library's included)."""
    top = module.split(".")[0]
    return top != "cloudckpt" and importlib.util.find_spec(top) is not None


def own_members(paths: list[Path]) -> set[str]:
    """The underscore names cloudckpt gives its own objects: the members of its classes
    and the attributes it assigns."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(stmt.name)
                    targets = (stmt.targets if isinstance(stmt, ast.Assign) else
                               [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _imports(tree: ast.AST) -> dict[str, str]:
    """Each name the module binds by importing from another package (at any depth of
    the module), and the dotted name it stands for."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _external(a.name):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                        a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and _external(node.module):
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


class _Scan:
    def __init__(self, path: str, tree: ast.AST, own: set[str]) -> None:
        self.path, self.tree, self.own = path, tree, own
        self.imported = _imports(tree)
        self.docs = docstring_ids(tree)
        self.found: list[Use] = []

    def report(self, node: ast.AST, name: str, what: str) -> None:
        self.found.append(Use(self.path, getattr(node, "lineno", 0), name, what))

    def run(self) -> list[Use]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self._dotted(node, a.name, f"import {a.name}")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    self._dotted(node, f"{node.module}.{a.name}",
                                 f"from {node.module} import {a.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                self._attribute(node)
            elif isinstance(node, ast.Call):
                self._getattr(node)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) not in self.docs and _DOTTED.fullmatch(node.value):
                    self._dotted(node, node.value, f"the string {node.value!r}")
            elif isinstance(node, ast.Tuple):
                self._pickle_global(node)
            elif isinstance(node, ast.ClassDef):
                self._overrides(node)
        return self.found

    def _dotted(self, node: ast.AST, dotted: str, what: str) -> None:
        name = _first_private(dotted)
        if name and _external(dotted) and dotted not in DOCUMENTED:
            self.report(node, name, what)

    def _attribute(self, node: ast.Attribute) -> None:
        parts, root = [node.attr], node.value
        while isinstance(root, ast.Attribute):
            parts.append(root.attr)
            root = root.value
        parts.reverse()
        text = ast.unparse(node)
        if isinstance(root, ast.Name) and root.id in self.imported:
            if not any(_private(p) for p in parts[:-1]):  # an inner one is reported
                self._dotted(node, ".".join([self.imported[root.id], *parts]), text)
            return
        holder = node.value
        if (isinstance(holder, ast.Call) and not (isinstance(holder.func, ast.Name)
                                                  and holder.func.id == "super")):
            self.report(node, node.attr, f"{text}: of what a call returned")
        elif ((isinstance(holder, ast.Name) and holder.id in FILESYSTEM_HOLDERS)
              or (isinstance(holder, ast.Attribute) and holder.attr in FILESYSTEM_HOLDERS)):
            self.report(node, node.attr, f"{text}: of an fsspec filesystem")
        elif node.attr not in self.own:
            self.report(node, node.attr, f"{text}: cloudckpt defines no {node.attr}")

    def _getattr(self, node: ast.Call) -> None:
        if not (isinstance(node.func, ast.Name) and node.func.id in _GETATTR_KIN
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            return
        obj, name = node.args[0], node.args[1].value
        if isinstance(obj, ast.Name) and obj.id in self.imported:
            self.report(node, name, f"{ast.unparse(node)}: of {self.imported[obj.id]}")
        elif name not in self.own:
            self.report(node, name, f"{ast.unparse(node)}: cloudckpt defines no {name}")

    def _pickle_global(self, node: ast.Tuple) -> None:
        values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        if (len(node.elts) == 2 and len(values) == 2 and all(isinstance(v, str) for v in values)
                and re.fullmatch(r"[A-Za-z_][\w.]*", values[0]) and _private(values[1])
                and _external(values[0])):
            self.report(node, values[1], f"the global {values[0]}.{values[1]}")

    def _overrides(self, node: ast.ClassDef) -> None:
        members = {s.name for s in node.body
                   if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
        members |= {t.id for s in node.body if isinstance(s, ast.Assign)
                    for t in s.targets if isinstance(t, ast.Name)}
        members |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"}
        for base in node.bases:
            dotted = ast.unparse(base)
            root = dotted.split(".")[0]
            if root not in self.imported:
                continue
            dotted = ".".join([self.imported[root], *dotted.split(".")[1:]])
            try:
                cls = compat.resolve(dotted, compat.Internal(""))
            except (LookupError, ImportError) as exc:
                self.report(node, node.name, f"class {node.name}: its base {dotted} does not "
                                             f"resolve ({exc}), so its members go unchecked")
                continue
            for name in sorted(m for m in members if _private(m) and hasattr(cls, m)):
                self.report(node, name, f"class {node.name} overrides {dotted}.{name}")


def private_uses(path: str, source: str, own: set[str]) -> list[Use]:
    """Every use of another package's private internal in ``source`` (see the module's
    docstring for what counts)."""
    return _Scan(path, ast.parse(source), own).run()


def _library_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if COMPAT not in p.parents)


def test_the_scan_finds_each_kind_of_private_use():
    source = '''
import argparse
import threading
import torch.serialization as ts
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
import gcsfs

class Mine(argparse.ArgumentParser):
    def __init__(self):
        self._pending = {}
    def use(self, fs, other):
        self._pending.clear()
        other._pending.clear()
        return fs._call_s3("head_object"), self.fs._call, other._nowhere, make()._client

class Retries(gcsfs.GCSFileSystem):
    _request = None

ALIAS = argparse._SubParsersAction
hook = getattr(threading, "_register_atexit", None)
ALLOWED = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
PICKLE = "torch._utils"
SAVE = ts._save
super()._read_options
'''
    own = {"_pending", "_read_options"}
    found = {(u.line, u.name) for u in private_uses("synthetic.py", source, own)}
    assert found == {
        (5, "_StorageInfo"), (6, "_nested_dict"), (15, "_call_s3"), (15, "_call"),
        (15, "_nowhere"), (15, "_client"), (17, "_request"),
        (20, "_SubParsersAction"), (21, "_register_atexit"), (22, "_get_layout"),
        (23, "_utils"), (24, "_save"),
    }, found


def test_no_private_internal_is_used_outside_compat():
    modules = _library_modules()
    own = own_members(modules)
    uses = [u for p in modules
            for u in private_uses(p.relative_to(PACKAGE).as_posix(), p.read_text(), own)]
    allowed = [u for u in uses if (u.path, u.name) in FRAMEWORK_INTERNALS]
    outside = [str(u) for u in uses if u not in allowed]
    assert not outside, (
        "private internals of other packages, used outside cloudckpt/compat/ (wrap each in "
        "that package's cloudckpt/compat/<package>_private.py and declare it in its "
        "INTERNALS):\n" + "\n".join(outside))
    stale = set(FRAMEWORK_INTERNALS) - {(u.path, u.name) for u in allowed}
    assert not stale, f"FRAMEWORK_INTERNALS lists what the integrations no longer use: {stale}"


def test_every_compat_module_declares_its_internals():
    files = {p.stem for p in COMPAT.glob("*.py")} - {"__init__"}
    assert files == set(compat.MODULES)
    for name in compat.MODULES:
        module = importlib.import_module(f"cloudckpt.compat.{name}")
        assert module.INTERNALS, name
        assert all(isinstance(i, compat.Internal) and i.why for i in module.INTERNALS.values())


def test_each_compat_module_declares_what_it_uses():
    # Scanned as if it owned nothing, a compat module reports every private name it
    # touches; each must be part of a name it declares, or the resolution test misses it.
    for module_name in compat.MODULES:
        module = importlib.import_module(f"cloudckpt.compat.{module_name}")
        declared = {part for name in module.INTERNALS
                    for part in name.replace("().", ".").split(".")}
        path = COMPAT / f"{module_name}.py"
        undeclared = [str(u) for u in private_uses(f"compat/{path.name}", path.read_text(),
                                                   set()) if u.name not in declared]
        assert not undeclared, "\n".join(undeclared)


def test_resolving_names_the_missing_part():
    assert compat.resolve("torch._utils._element_size", compat.Internal("x")) is not None
    with pytest.raises(LookupError, match=r"torch\._utils has no attribute '_gone'"):
        compat.resolve("torch._utils._gone", compat.Internal("x"))
    with pytest.raises(LookupError, match="no module 'no_such_package'"):
        compat.resolve("no_such_package._x", compat.Internal("x"))
    made = compat.Internal("x", instance=lambda: ValueError("v"))
    assert compat.resolve("builtins.ValueError().args", made) == ("v",)
    with pytest.raises(LookupError, match=r"builtins\.ValueError\(\) has no attribute '_gone'"):
        compat.resolve("builtins.ValueError()._gone", made)
    with pytest.raises(LookupError, match="not a builtins.KeyError"):
        compat.resolve("builtins.KeyError().args", made)


def _declared() -> list[tuple[str, str, compat.Internal]]:
    out = []
    for module_name in compat.MODULES:
        module = importlib.import_module(f"cloudckpt.compat.{module_name}")
        out += [(module_name, name, internal) for name, internal in module.INTERNALS.items()]
    return out


def _installed(name: str) -> str:
    top = name.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top)
    if not dists:
        return f"Python {platform.python_version()}"
    return ", ".join(f"{d} {importlib.metadata.version(d)}" for d in sorted(set(dists)))


@pytest.mark.parametrize(("module", "name", "internal"),
                         [pytest.param(*d, id=d[1]) for d in _declared()])
def test_each_declared_internal_resolves(module: str, name: str, internal: compat.Internal):
    try:
        compat.resolve(name, internal)
    except (LookupError, ImportError) as exc:
        pytest.fail(f"{name} is not there on {_installed(name)} ({exc}). "
                    f"cloudckpt.compat.{module} wraps it ({internal.why}): adapt it there")
