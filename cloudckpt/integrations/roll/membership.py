"""How a ROLL checkpoint is known complete without a count from the user.

ROLL's pipeline calls ``upload`` for ``checkpoint-N`` only after every checkpoint
cluster's ``do_checkpoint`` returned (``BasePipeline.do_checkpoint``), and inside a
cluster every rank of its process group calls it (``fsdp2_strategy.save_checkpoint``, and
the megatron and deepspeed strategies alike). So each part declares the set it belongs
to: its cluster (the worker name without its rank: ``actor_train-3`` is rank 3 of
``actor_train``) and that cluster's world size (its ``torch.distributed`` group); the
pipeline's part is a set of one. Each part also announces itself (an *intent* object)
when ``upload`` is called, before its files go up.

A checkpoint is complete when the pipeline's part is in, every part announced is in,
every cluster a part names (or an earlier checkpoint of the run had) has all its ranks,
and the parts hold all that ROLL's resume reads (:mod:`.parts`: every DCP shard each
``.metadata`` names). A checkpoint that never meets them is reported
(``parts_timeout``), never waited for forever. The one gap: on the run's first
checkpoint, a cluster none of whose ranks had even called ``upload`` when the pipeline's
part was checked (an async upload thread not yet started) is not seen; set
``expected_uploads`` where that can happen.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from cloudckpt.integrations.roll.plugin import PARTS_DIR
from cloudckpt.storage import Store

#: The pipeline's part: ROLL's driver uploads it last, after every cluster's ranks.
PIPELINE = "pipeline"
#: The announcement of a part whose files are on their way.
INTENT_SUFFIX = ".intent"
_WORKER_RE = re.compile(r"^(?P<group>.+)-(?P<rank>\d+)$")


def declare(part: str) -> dict[str, Any]:
    """The set ``part`` belongs to: its cluster, its rank there and the cluster's size
    (from this process's ``torch.distributed`` group, when it has one and the part is
    named for its rank there, as ROLL names its workers); else a set of one."""
    dist = sys.modules.get("torch.distributed")
    m = _WORKER_RE.match(part)
    if (m and dist is not None and dist.is_available() and dist.is_initialized()
            and int(m.group("rank")) == dist.get_rank()):
        return {"group": m.group("group"), "rank": dist.get_rank(),
                "world": dist.get_world_size()}
    return {"group": part, "rank": 0, "world": 1}


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
    this run, each of which must be here too."""
    names = {str(m.get("part")) for m in parts.values()}
    out = []
    if PIPELINE not in names:
        out.append("the pipeline's part (ROLL uploads it after every cluster's ranks)")
    out += [f"part {p!r} (announced, still uploading)" for p in sorted(intents - names)]
    groups: dict[str, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    for m in parts.values():
        if "group" in m:
            groups[str(m["group"])][int(m["world"])].add(int(m["rank"]))
    out += [f"every part of {g} (in an earlier checkpoint of this run)"
            for g in sorted(set(known) - set(groups))]
    for group, by_world in sorted(groups.items()):
        if len(by_world) > 1:
            out.append(f"{group}: its parts disagree on its size ({sorted(by_world)})")
            continue
        ((world, ranks),) = by_world.items()
        gone = sorted(set(range(world)) - ranks)
        if gone:
            shown = ", ".join(f"{group}-{r}" for r in gone[:5])
            out.append(f"{len(gone)} of {world} ranks of {group} ({shown})")
    return out
