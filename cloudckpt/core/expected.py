"""What a load checks of a committed checkpoint before it applies anything: its kind,
the step its name says, the number of ranks that saved its per-rank state.

Every load path (the manager's restore, each integration's) makes these checks
with these functions, from the manifest and its metadata alone, before a single
tensor or state of the caller's is overwritten: a refused load leaves the model,
the optimizer and the rest as they were, and says the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Collection

from cloudckpt.core.committed import Checkpoint
from cloudckpt.errors import CorruptCheckpointError, WorldSizeError
from cloudckpt.util.text import plural


def expect_kind(ckpt: Checkpoint, kinds: str | Collection[str], what: str) -> Checkpoint:
    """``ckpt`` if its manifest kind is one of ``kinds``; else refused, ``what`` saying
    what the load wanted (``"a verl step"``)."""
    wanted = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    if ckpt.manifest.kind not in wanted:
        raise CorruptCheckpointError(
            f"{ckpt.uri} is a {ckpt.manifest.kind!r} checkpoint, not {what} "
            f"({' or '.join(map(repr, wanted))})")
    return ckpt


def expect_step(ckpt: Checkpoint, step: int | None) -> Checkpoint:
    """``ckpt`` if its manifest's step is ``step``, the one its name says (None: a name
    without one; a manifest without a step is not refused)."""
    if step is not None and ckpt.step is not None and ckpt.step != step:
        raise CorruptCheckpointError(
            f"{ckpt.uri} is named for step {step} but its manifest says step {ckpt.step}; "
            "was it renamed or copied to the wrong place? Resume from the checkpoint under "
            "its own name, or move it back there")
    return ckpt


def expect_world_size(uri: str, saved: int, world: int, *, holds: str,
                      otherwise: str = "") -> None:
    """Refuse state saved one per rank by ``saved`` ranks on a job of ``world``:
    ``holds`` says what that state is, ``otherwise`` (``", or ..."``) another way out
    than resuming with as many ranks."""
    if saved != world:
        raise WorldSizeError(f"{uri} holds {holds} of {plural(saved, 'rank')}; this job has "
                             f"{plural(world, 'rank')}. Resume with {plural(saved, 'rank')}"
                             f"{otherwise}.")
