"""AReaL's experiment YAML, read as AReaL's ``load_expr_config`` reads it (YAML 1.1
scalars: a bare ``on`` is true), ``${a.b}`` interpolations resolved: the ``saver`` and
``recover`` sections as config objects."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.integrations.areal.config import RecoverConfig, SaverConfig


def load_yaml(path: str | os.PathLike) -> tuple[SaverConfig, RecoverConfig]:
    """Read an AReaL experiment YAML and return its ``saver`` and ``recover`` sections.

    ``${a.b}`` interpolations (as OmegaConf writes them, e.g. ``${cluster.fileroot}``)
    are resolved against the whole document.
    """
    with open(path) as f:
        doc = _yaml_load(f.read())
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} is not a YAML mapping")
    for section in ("saver", "recover"):
        if not isinstance(doc.get(section), dict):
            raise ConfigError(f"{path} has no '{section}:' section")
    resolved = {s: {k: _interpolate(v, doc, str(path)) for k, v in doc[s].items()}
                for s in ("saver", "recover")}
    return SaverConfig.from_dict(resolved["saver"]), RecoverConfig.from_dict(resolved["recover"])


def pyyaml(needed_by: str) -> ModuleType:
    """PyYAML, imported when AReaL's YAML is read: it is the ``areal`` extra's, not a
    dependency of every install. ``needed_by`` names the reading in the error."""
    try:
        import yaml
    except ImportError as exc:
        raise ConfigError(f"{needed_by} needs pyyaml ({exc}): "
                          "pip install 'cloudckpt[areal]'") from exc
    return yaml


def _yaml_load(text: str) -> Any:
    """YAML as OmegaConf (AReaL's loader) reads it: YAML 1.1, so ``mode: on`` is True,
    which AReaL refuses (and so does :class:`RecoverConfig`, saying to quote it)."""
    return pyyaml("reading an AReaL config").safe_load(text)


_INTERP = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _interpolate(value: Any, doc: Mapping[str, Any], source: str, depth: int = 0) -> Any:
    if not isinstance(value, str) or "${" not in value:
        return value
    if depth > 8:
        raise ConfigError(f"{source}: interpolation of {value!r} does not terminate")

    def lookup(ref: str) -> Any:
        node: Any = doc
        for part in ref.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise ConfigError(f"{source}: ${{{ref}}} names no key of the document")
            node = node[part]
        return _interpolate(node, doc, source, depth + 1)

    whole = _INTERP.fullmatch(value)
    if whole:
        return lookup(whole.group(1))
    return _INTERP.sub(lambda m: str(lookup(m.group(1))), value)
