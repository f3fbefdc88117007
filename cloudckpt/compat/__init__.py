"""Every private internal of a dependency that cloudckpt uses, one module per dependency.

A dependency's underscore names (and the few undocumented helpers we call) can change
in any release without notice. Keeping each behind a small named function or alias
here, declared in its module's ``INTERNALS``, means an upgrade that moves one fails
one test naming it (``tests/test_private_api.py`` resolves every declared name on the
installed versions) instead of a save somewhere in the middle of a run; and the rest
of cloudckpt imports no private name of another package (the same test scans for any).

The modules are named ``<dependency>_private`` so that none can shadow the package it
wraps. Each is imported only by the layers that already import its dependency: this
package adds no import to any of them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The compat modules, one per dependency (``tests/test_private_api.py`` reads them all).
MODULES = (
    "argparse_private",
    "azure_private",
    "gcsfs_private",
    "hub_private",
    "numpy_private",
    "s3fs_private",
    "threading_private",
    "torch_private",
    "transformers_private",
)


@dataclass(frozen=True)
class Internal:
    """One private internal: why cloudckpt needs it, and for an attribute only an
    instance has (named ``"package.Class().attribute"``), how to make an instance
    without touching the network."""

    why: str
    instance: Callable[[], Any] | None = None


def resolve(name: str, internal: Internal) -> Any:
    """What ``name`` is on the installed versions: ``"a.b.c"`` imports the longest
    importable module prefix and looks the rest up as attributes; ``"a.B().c"`` looks
    ``c`` up on ``internal.instance()``, which must be an ``a.B``. Raises
    :class:`LookupError` saying which part is missing."""
    owner_name, made, rest = name.partition("().")
    owner = _by_name(owner_name)
    if not made:
        return owner
    if internal.instance is None:
        raise LookupError(f"{name} names an instance attribute but declares no instance")
    obj = internal.instance()
    if not isinstance(obj, owner):
        raise LookupError(f"{name}: the declared instance is a {type(obj).__name__}, "
                          f"not a {owner_name}")
    return _attributes(obj, rest.split("."), owner_name + "()")


def _by_name(dotted: str) -> Any:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not ".".join(parts[:i]).startswith(exc.name):
                raise  # the module exists; something it imports does not
            continue
        return _attributes(module, parts[i:], ".".join(parts[:i]))
    raise LookupError(f"{dotted}: no module {parts[0]!r} is installed")


def _attributes(obj: Any, names: list[str], where: str) -> Any:
    for name in names:
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise LookupError(f"{where} has no attribute {name!r}") from None
        where = f"{where}.{name}"
    return obj
