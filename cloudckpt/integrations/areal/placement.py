"""Where the paths of an AReaL config land when ``cluster.fileroot`` is a bucket URI.

AReaL derives every path from ``cluster.fileroot`` (its examples write
``fileroot: ${cluster.fileroot}`` in each section), and all but two of them feed local
file calls: the log directory and its ``config.yaml`` copy (``stats_logger``), perf
traces (``perf_tracer``), trajectory dumps (``rollout``), name-resolve records
(``cluster.name_resolve.nfs_record_root``), the launchers' logs and metadata and the RL
trainer's disk weight updates (``cluster.fileroot`` itself). The two others are the
checkpoints: ``saver.fileroot`` and ``recover.fileroot``, which cloudckpt's ``Saver`` and
``RecoverHandler`` write to the bucket.

So :func:`place` keeps those two in the bucket (their resolved values, written in) and
gives every other key whose value is a bucket URI the local directory
:func:`~cloudckpt.runtime.localdirs.local_dir_for` names for it, ``cluster.fileroot``
included, so that anything else derived from it follows. It works on the composed,
unresolved config (an OmegaConf ``DictConfig``, as hydra composes it), before AReaL
merges its defaults; the activation binding and the doctor both use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.runtime.localdirs import local_dir_for
from cloudckpt.storage import is_remote

#: The sections whose ``fileroot`` holds checkpoints: they stay in the bucket.
CHECKPOINTS = ("saver.fileroot", "recover.fileroot")
NFS_ROOT = "cluster.name_resolve.nfs_record_root"
#: AReaL 1.0.4's defaults of the keys a config may leave out (``ClusterSpecConfig``,
#: ``NameResolveConfig``); the sections' ``fileroot`` has none (it is required).
DEFAULTS = {"cluster.fileroot": "/tmp/areal/", NFS_ROOT: "/tmp/areal/name_resolve"}
#: What AReaL keeps under each key.
HOLDS = {
    "cluster.fileroot": "AReaL's root for local files (launcher logs, metadata, "
                        "disk weight updates, and every key derived from it)",
    "saver.fileroot": "HF exports (Saver)",
    "recover.fileroot": "recover dumps (RecoverHandler)",
    "evaluator.fileroot": "nothing (the evaluator's timer names no file)",
    "stats_logger.fileroot": "logs: config.yaml copy, trainer log, trackers' files",
    "perf_tracer.fileroot": "perf traces",
    "rollout.fileroot": "trajectory dumps",
    NFS_ROOT: "name-resolve records",
}


@dataclass(frozen=True)
class Placed:
    """One path key of the config: its value (resolved) and where it lands under
    activation."""

    key: str
    value: str | None
    lands: str | None
    #: Why activation refuses it, and the key to set instead.
    problem: str | None = None

    @property
    def in_bucket(self) -> bool:
        return is_remote(self.lands)

    @property
    def moved(self) -> bool:
        return self.lands != self.value


def path_keys(cfg: Any) -> list[str]:
    """The dotted keys of ``cfg`` that AReaL derives paths from: every ``fileroot`` (at
    any depth) and the NFS name-resolve root, plus those two's defaults if absent."""
    from omegaconf import OmegaConf

    found = _present(OmegaConf.to_container(cfg, resolve=False))
    found += [key for key in DEFAULTS if key not in found]
    return sorted(found, key=lambda k: (k not in DEFAULTS, k))


def _present(node: Any, prefix: str = "") -> list[str]:
    """The path keys written in ``node`` (a container, interpolations unresolved)."""
    found = []
    for key, child in (node.items() if isinstance(node, dict) else ()):
        dotted = f"{prefix}{key}"
        if isinstance(child, dict):
            found += _present(child, f"{dotted}.")
        elif key == "fileroot" or dotted == NFS_ROOT:
            found.append(dotted)
    return found


def _resolved(cfg: Any, key: str) -> str | None:
    """``key``'s value, interpolations resolved; AReaL's default where it is absent,
    None where it is required and unset (``???``) or unresolvable."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parent, _, name = key.rpartition(".")
    try:
        node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        if not isinstance(node, DictConfig) or name not in node.keys():
            return DEFAULTS.get(key)
        if OmegaConf.is_missing(node, name):
            return None
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    except OmegaConfBaseException:  # an interpolation to a value still missing
        return None
    return None if value is None else str(value)


def plan(cfg: Any, *, environ: Any = None, cwd: str | None = None) -> list[Placed]:
    """Every path key of ``cfg`` and where it lands under activation (with a
    ``problem`` where it is a bucket URI AReaL could only use as a local path and
    cloudckpt cannot place)."""
    environ = os.environ if environ is None else environ
    nodes = _nodes(environ)
    placed = []
    for key in path_keys(cfg):
        value = _resolved(cfg, key)
        lands, problem = value, None
        if is_remote(value) and key not in CHECKPOINTS:
            if key == NFS_ROOT and not _derived(cfg, key):
                problem = (f"AReaL's name-resolve records are files its processes read "
                           f"and write with local file calls, which no bucket holds: set "
                           f"{key} to a local (or shared) directory, or leave it out")
            elif key == NFS_ROOT and _nfs(cfg) and nodes > 1:
                problem = (f"this job runs on {nodes} nodes, whose processes find "
                           f"each other through name-resolve records in one shared "
                           f"directory; derived from a bucket, {key} would be a local "
                           f"directory on each node: set it to a shared (NFS) directory, "
                           f"or cluster.name_resolve.type to etcd3 or ray")
            else:
                lands = local_dir_for(value, environ=environ, cwd=cwd)
        placed.append(Placed(key, value, lands, problem))
    return placed


def _nfs(cfg: Any) -> bool:
    """Whether name resolution goes through files (AReaL's default type, ``nfs``)."""
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, "cluster.name_resolve.type", default="nfs") == "nfs"


def _nodes(environ: Any) -> int:
    """The nodes of this process's job, as torchrun tells its workers (1 if unknown)."""
    world, local = environ.get("WORLD_SIZE", ""), environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0:
        return max(1, -(-int(world) // int(local)))
    return 1


def _derived(cfg: Any, key: str) -> bool:
    """Whether ``key``'s value is written as an interpolation (``${cluster.fileroot}/x``)."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, key.rpartition(".")[0])
    return node is not None and OmegaConf.is_interpolation(node, key.rpartition(".")[2])


def recover_mode(cfg: Any) -> Any:
    """``recover.mode`` as the config writes it (None if absent)."""
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, "recover.mode", default=None, throw_on_missing=False)


def place(cfg: Any, *, environ: Any = None, cwd: str | None = None) -> list[Placed]:
    """Rewrite ``cfg`` (in place) as :func:`plan` says, when any of its path keys is a
    bucket URI: each key's resolved value written in, a bucket URI of a local key as its
    local directory (created, as AReaL's launchers want ``cluster.fileroot`` to exist).
    A bare YAML ``on``/``off`` for ``recover.mode`` of a bucket ``recover.fileroot``
    (YAML 1.1 reads it as a boolean, which AReaL refuses) becomes ``"on"``/``"off"``.
    Returns the plan; a config without bucket URIs is left as it is."""
    from omegaconf import OmegaConf

    placed = plan(cfg, environ=environ, cwd=cwd)
    if not any(is_remote(p.value) for p in placed):
        return placed
    refused = [f"{p.key} = {p.value}: {p.problem}" for p in placed if p.problem]
    if refused:
        raise ConfigError("; ".join(refused))
    written = _present(OmegaConf.to_container(cfg, resolve=False))
    for p in placed:
        # Every key written in gets its value resolved now: a checkpoint section's
        # ``${cluster.fileroot}`` stays the bucket once cluster.fileroot is local.
        if p.value is not None and (p.key in written or p.moved):
            OmegaConf.update(cfg, p.key, p.lands, merge=False, force_add=True)
        if p.moved and p.key in ("cluster.fileroot", NFS_ROOT):
            os.makedirs(str(p.lands), exist_ok=True)
    mode = recover_mode(cfg)
    if isinstance(mode, bool) and is_remote(_value(placed, "recover.fileroot")):
        OmegaConf.update(cfg, "recover.mode", "on" if mode else "off", merge=False)
    return placed


def _value(placed: list[Placed], key: str) -> str | None:
    return next((p.value for p in placed if p.key == key), None)
