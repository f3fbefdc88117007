"""verl's ``checkpoint.save_contents`` / ``load_contents`` and LoRA-only saves as save
profiles (:mod:`cloudckpt.core.profiles`).

A role part records what verl saved: ``full`` with ``model``, ``optimizer`` and
``extra`` (the LR scheduler and the RNG) all saved; ``weights`` lacking what
``save_contents`` leaves out; ``adapters`` when verl saves the LoRA parameters only
(the FSDP manager's ``save_lora_only`` on a PEFT model, the Megatron manager's PEFT
saves). A resume whose ``load_contents`` asks for what the part lacks is refused before
anything is applied, naming the entries to leave out of ``load_contents`` (verl's own
way to load less), unless ``$CLOUDCKPT_ALLOW_PARTIAL_RESUME`` allows it: then what the
part lacks starts fresh, as if ``load_contents`` left it out. A LoRA-only part resumes
onto the base model verl builds, as verl's own load does: its frozen weights are never
asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cloudckpt.core.profiles import ADAPTERS, FULL, PROFILE_KEY, WEIGHTS, Profile, recorded
from cloudckpt.integrations import check_framework_resume

#: What each entry of ``save_contents`` / ``load_contents`` holds of the training state.
PARTS = {"model": ("model",), "optimizer": ("optimizer",), "extra": ("lr_scheduler", "rng")}
#: The keys of verl's config naming what a role loads.
LOAD_CONTENTS = ("actor_rollout_ref.actor.checkpoint.load_contents (critic.checkpoint."
                 "load_contents for the critic)")
_FROZEN = "frozen weights"


def lacked(contents: Iterable[str]) -> list[str]:
    """What a save with these ``save_contents`` leaves out of the training state."""
    have = set(contents)
    return [part for key, parts in PARTS.items() if key not in have for part in parts]


def wanted(contents: Iterable[str]) -> set[str]:
    """What a load with these ``load_contents`` applies of the training state."""
    return {part for key in contents for part in PARTS.get(key, ())}


def lora_only(manager: Any) -> bool:
    """Whether verl's ``manager`` saves the LoRA parameters only, by its own rule: the
    Megatron manager's PEFT saves, the FSDP manager's ``save_lora_only`` on a PEFT model."""
    if hasattr(manager, "peft_cls"):  # the Megatron manager
        return manager.peft_cls is not None
    return bool(getattr(manager, "should_save_lora_only", False)) and manager._has_lora()


def saved(manager: Any) -> Profile:
    """The profile of a save by verl's ``manager`` (its ``checkpoint_save_contents``)."""
    lacks = lacked(manager.checkpoint_save_contents)
    if "model" not in lacks and lora_only(manager):
        return Profile(ADAPTERS, (*lacks, _FROZEN))
    return Profile(WEIGHTS if lacks else FULL, tuple(lacks))


def of_part(metadata: Mapping[str, Any]) -> Profile:
    """A part's profile: its record, else what the ``contents`` it records leave out."""
    if PROFILE_KEY in metadata:
        return recorded(metadata)
    contents = metadata.get("contents")
    if isinstance(contents, list):
        lacks = lacked(str(c) for c in contents)
        return Profile(WEIGHTS if lacks else FULL, tuple(lacks))
    return Profile()


def check_load(uri: str, metadata: Mapping[str, Any], load_contents: Iterable[str],
               config_key: str = LOAD_CONTENTS) -> set[str]:
    """What of the part at ``uri`` a load with ``load_contents`` skips: nothing, or, a
    partial resume allowed, what the part lacks (a PartialCheckpointError otherwise,
    naming the entries to leave out of ``config_key``)."""
    contents = list(load_contents)
    profile = of_part(metadata)
    leave_out = [key for key in contents if set(PARTS.get(key, ())) & set(profile.lacks)]
    how = f"leave {', '.join(map(repr, leave_out))} out of {config_key}"
    return set(check_framework_resume(uri, profile, wanted(contents), framework_key=how))


def narrowed(load_contents: Iterable[str], fresh: set[str]) -> list[str]:
    """``load_contents`` without the entries whose state starts fresh."""
    return [key for key in load_contents if not set(PARTS.get(key, ())) & fresh]
