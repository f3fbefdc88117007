"""How a ROLL checkpoint is known complete without a count from the user.

ROLL's pipeline calls ``upload`` for ``checkpoint-N`` after every checkpoint cluster's
``do_checkpoint`` returned (``BasePipeline.do_checkpoint``), and inside a cluster every
rank calls it (``fsdp2_strategy.save_checkpoint``, and the megatron and deepspeed
strategies alike) once its DCP save is done: with ROLL's async DCP saves and uploads
(its defaults), well after the pipeline's. So each part declares the set it belongs
to: its cluster and rank there and the cluster's size (``CLUSTER_NAME``, ``RANK``,
``WORLD_SIZE``, which ROLL sets in every worker); the pipeline's part is a set of one,
and it names every checkpoint cluster of the job with its size, read from ROLL's
pipeline object as it uploads (:mod:`.pipeline`). Each part also announces itself (an
*intent* object) when ``upload`` is called, before its files go up.

A checkpoint is complete when the pipeline's part and at least one cluster's are in,
every part announced is in, every cluster a part names (the pipeline's part: each of
the pipeline's checkpoint clusters) or the newest committed checkpoint of the output
directory recorded (any attempt) has all its ranks, and the parts hold all that ROLL's
resume reads (:mod:`.markers`: every DCP shard each ``.metadata`` names). So a cluster
whose ranks upload late (a critic's async save) holds its checkpoint back, the first
one of an output directory too. A checkpoint that never meets them is reported
(``parts_timeout``), never waited for forever. Where no pipeline object built the
driver's uploader (a ``CheckpointManager`` driven by hand), its part names no cluster:
the first checkpoint of an output directory then commits without a cluster none of
whose ranks had called ``upload`` yet (``expected_uploads`` closes that gap for such a
job).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from cloudckpt.integrations.roll.layout import PARTS_DIR
from cloudckpt.storage import Store
from cloudckpt.util.text import plural

#: The pipeline's part: ROLL's driver uploads it last, after every cluster's ranks.
PIPELINE = "pipeline"
#: The announcement of a part whose files are on their way.
INTENT_SUFFIX = ".intent"
_WORKER_RE = re.compile(r"^(?P<group>.+)-(?P<rank>\d+)$")


def declare(part: str, environ: Mapping[str, str] | None = None, *,
            clusters: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The set ``part`` belongs to: its cluster, its rank there and the cluster's size.
    ROLL starts every worker with ``CLUSTER_NAME``, ``RANK`` and ``WORLD_SIZE`` set and
    names its directory for it (``actor_train-3``, or ``actor_train-3-G3`` on a GPU);
    without them, the part named for its rank in this process's ``torch.distributed``
    group; else a set of one. With ``clusters`` (the pipeline's part: ``{cluster_name:
    world_size}`` of its checkpoint clusters), each of them is declared too."""
    out = _member(part, os.environ if environ is None else environ)
    if clusters:
        out["clusters"] = {str(k): int(v) for k, v in clusters.items()}
    return out


def _member(part: str, env: Mapping[str, str]) -> dict[str, Any]:
    cluster = env.get("CLUSTER_NAME")
    if cluster and part.startswith(f"{cluster}-") and env.get("RANK", "").isdigit() \
            and env.get("WORLD_SIZE", "").isdigit():
        return {"group": cluster, "rank": int(env["RANK"]), "world": int(env["WORLD_SIZE"])}
    dist = sys.modules.get("torch.distributed")
    m = _WORKER_RE.match(part)
    if (m and dist is not None and dist.is_available() and dist.is_initialized()
            and int(m.group("rank")) == dist.get_rank()):
        return {"group": m.group("group"), "rank": dist.get_rank(),
                "world": dist.get_world_size()}
    return {"group": part, "rank": 0, "world": 1}


def clusters(parts: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """``{cluster: size}`` of the parts besides the pipeline's: what a committed
    checkpoint records, so that later ones of the run (any attempt) need them all."""
    return {str(m["group"]): int(m["world"]) for m in parts.values()
            if "group" in m and m["group"] != PIPELINE}


def _declared(parts: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """``{cluster: size}`` the parts declare: only the pipeline's names clusters (its
    checkpoint clusters); were two to differ on a size, the largest is kept."""
    out: dict[str, int] = {}
    for m in parts.values():
        for name, world in dict(m.get("clusters") or {}).items():
            out[str(name)] = max(int(world), out.get(str(name), 0))
    return out


def announce(store: Store, part: str, attempt: str | None) -> None:
    """Say that ``part`` of the checkpoint at ``store`` is on its way."""
    body = {"part": part, "attempt": attempt, "created": time.time()}
    store.put(f"{PARTS_DIR}/{part}{INTENT_SUFFIX}", json.dumps(body).encode())


def announced(store: Store, attempt: str | None, since: float) -> set[str]:
    """The parts of this attempt announced in the checkpoint at ``store``."""
    out = set()
    for o in store.list(PARTS_DIR):
        if not o.key.endswith(INTENT_SUFFIX):
            continue
        try:
            body = json.loads(store.get(o.key))
        except (FileNotFoundError, ValueError):
            continue  # committed and cleaned up meanwhile, or unreadable
        current = (body.get("attempt") == attempt if attempt
                   else float(body.get("created", 0)) >= since)
        if current:
            out.add(str(body.get("part")))
    return out


def missing(parts: Mapping[str, Mapping[str, Any]], intents: set[str],
            known: Iterable[str] = ()) -> list[str]:
    """What keeps the current ``parts`` from being the whole checkpoint (empty: nothing);
    ``intents``: the parts announced; ``known``: the clusters of earlier checkpoints of
    this run, each of which must be here too, as must every cluster a part declares
    (the pipeline's: ``clusters``), with the size declared."""
    names = {str(m.get("part")) for m in parts.values()}
    out = []
    if PIPELINE not in names:
        out.append("the pipeline's part (ROLL uploads it after every cluster's ranks)")
    out += [f"part {p!r} (announced, still uploading)" for p in sorted(intents - names)]
    groups: dict[str, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    for m in parts.values():
        if "group" in m:
            groups[str(m["group"])][int(m["world"])].add(int(m["rank"]))
    if not set(groups) - {PIPELINE}:
        out.append("the parts of a checkpoint cluster (the pipeline's part alone is no "
                   "checkpoint: ROLL's workers may still be saving theirs)")
    declared = _declared(parts)
    out += [f"every part of {g} ({plural(world, 'rank')}: a checkpoint cluster of ROLL's "
            f"pipeline, none of whose ranks has uploaded yet)"
            for g, world in sorted(declared.items()) if g not in groups]
    out += [f"every part of {g} (the newest committed checkpoint has it; a job without "
            f"{g} sets checkpoint_config.expected_uploads, or writes to a new output_dir)"
            for g in sorted(set(known) - set(groups) - set(declared))]
    for group, by_world in sorted(groups.items()):
        if len(by_world) > 1 or (group in declared and set(by_world) != {declared[group]}):
            sizes = sorted({*by_world, *([declared[group]] if group in declared else [])})
            out.append(f"{group}: its parts disagree on its size ({sizes})")
            continue
        ((world, ranks),) = by_world.items()
        gone = sorted(set(range(world)) - ranks)
        if gone:
            shown = ", ".join(f"{group}-{r}" for r in gone[:5])
            out.append(f"{len(gone)} of {world} ranks of {group} ({shown})")
    return out
