"""Save profiles: what a checkpoint holds of the training state, recorded in its
manifest, and what a resume from it would have to start fresh.

``full`` holds everything a resume needs; ``weights`` the model only (no optimizer,
RNG, data loader or other state); ``adapters`` only the trainable parameters (a
LoRA adapter). A manifest without a record is ``full``. Every load path that can
resume training (the manager's, each integration's) checks the record with
:func:`check_resume` before it applies anything, so a resume never continues from a
partial checkpoint unnoticed: it is refused, or, when the user allows a partial
resume, it goes on with a WARNING naming what starts fresh.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from cloudckpt.errors import ConfigError, PartialCheckpointError

log = logging.getLogger(__name__)

FULL, WEIGHTS, ADAPTERS = "full", "weights", "adapters"
PROFILES = (FULL, WEIGHTS, ADAPTERS)
#: The manifest metadata key of the record.
PROFILE_KEY = "profile"
#: The names of two parts a record's ``lacks`` may list besides the names of states:
#: the random generators' state, and the model's weights an ``adapters`` save leaves out.
RNG, FROZEN = "rng", "frozen weights"


def check_name(name: str) -> str:
    """``name`` if it is a profile; else a :class:`ConfigError` listing them."""
    if name not in PROFILES:
        raise ConfigError(f"unknown save profile {name!r}: use one of "
                          f"{', '.join(map(repr, PROFILES))}")
    return name


@dataclass(frozen=True)
class Profile:
    """What one save holds: the profile's ``name`` and the parts of the training state
    left out (``lacks``: ``"optimizer"``, ``"rng"``, ``"dataloader"``, the names of
    other state; for ``adapters`` also ``"frozen weights"``). The names are those the
    saver's resume asks for: the manager's are the state's own names (its entries
    beside the model, ``optim``; its ``per_rank`` and ``extra`` states), :data:`RNG`
    and :data:`FROZEN`, so that a resume compares them with what it loads."""

    name: str = FULL
    lacks: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        check_name(self.name)

    def record(self) -> dict[str, Any]:
        """The manifest metadata entry (``{PROFILE_KEY: record()}``)."""
        return {"name": self.name, "lacks": sorted(self.lacks)}


def recorded(metadata: Mapping[str, Any] | None) -> Profile:
    """The profile a manifest's ``metadata`` records (``full`` without a record)."""
    entry = (metadata or {}).get(PROFILE_KEY)
    if not isinstance(entry, Mapping):
        return Profile()
    name = entry.get("name", FULL)
    lacks = entry.get("lacks") or ()
    if name not in PROFILES or not isinstance(lacks, list | tuple):
        return Profile(FULL, ())
    return Profile(str(name), tuple(str(x) for x in lacks))


def check_resume(uri: str, profile: Profile, wanted: Collection[str], *,
                 allow_partial: bool, how_to_allow: str) -> list[str]:
    """What of ``wanted`` (the parts of the state this resume would load) the checkpoint
    at ``uri`` lacks by its ``profile``; refused with :class:`PartialCheckpointError`
    unless ``allow_partial``, and then a WARNING names what starts fresh.
    ``how_to_allow`` says how the user allows it (``"restore(..., allow_partial=True)"``)."""
    lacking = sorted(set(profile.lacks) & set(wanted))
    if not lacking:
        return []
    what = ", ".join(lacking)
    if not allow_partial:
        raise PartialCheckpointError(
            f"{uri} is a {profile.name!r} save: it holds no {what}, which this resume "
            f"would load. Resume from a 'full' checkpoint, or allow a partial resume "
            f"({how_to_allow}) to load what it holds and start {what} fresh")
    log.warning("partial resume from %s (a %r save): %s start(s) fresh", uri, profile.name, what)
    return lacking
