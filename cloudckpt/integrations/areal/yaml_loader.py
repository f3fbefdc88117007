"""AReaL's experiment YAML, read as OmegaConf reads it, ``${a.b}`` interpolations
resolved: the ``saver`` and ``recover`` sections as config objects."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
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


def _yaml_load(text: str) -> Any:
    """YAML as OmegaConf (AReaL's loader) reads it: only true/false are booleans, so
    ``mode: on`` stays the string "on" instead of YAML 1.1's True."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        ch: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:bool"]
        for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|"
                                 r"false|False|FALSE)$"), list("tTfF"))
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


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
