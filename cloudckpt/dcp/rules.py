"""How a tensor is split over the ranks that saved it, as a rule rather than a list.

A sharded tensor saved by ``world`` ranks has ``world`` chunks; listing them all
makes metadata grow with ranks. Where the split is regular, a :class:`Rule` says
which chunk every rank holds, computed for any rank in O(1):

- ``whole``: the tensor in one piece (a plain or replicated tensor). Every rank
  holds all of it; one rank writes it (:func:`owner`), and the index records where.
- ``chunked(dim, parts)``: ``torch.chunk``'s split of ``dim`` into ``parts``
  (``ceil(size / parts)`` rows a part, trailing parts short or empty), rank ``r``
  holding part ``r``: FSDP's ``Shard(0)`` on a one-dimensional mesh.

Anything else (a multi-dimensional mesh, uneven splits of another kind) is
irregular: :func:`infer_rule` returns None and the save takes the classic path.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cloudckpt.errors import CorruptCheckpointError

WHOLE = "whole"
CHUNKED = "chunked"

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Rule:
    """Which chunk of a tensor each saved rank holds (see the module's docstring)."""

    kind: str
    dim: int = 0
    parts: int = 1

    def __post_init__(self) -> None:
        if self.kind not in (WHOLE, CHUNKED):
            raise ValueError(f"unknown rule kind {self.kind!r}")
        if self.kind == CHUNKED and (self.dim < 0 or self.parts < 1):
            raise ValueError(f"a chunked rule needs dim >= 0 and parts >= 1, not {self}")

    @staticmethod
    def whole() -> Rule:
        return Rule(WHOLE)

    @staticmethod
    def chunked(dim: int, parts: int) -> Rule:
        return Rule(CHUNKED, dim, parts)

    def _step(self, size: Sequence[int]) -> int:
        """Rows of ``dim`` a part holds (the last ones fewer)."""
        return -(-size[self.dim] // self.parts)

    def filled(self, size: Sequence[int]) -> int:
        """How many parts of a tensor of ``size`` hold any of it: ranks ``0 ..
        filled - 1``; the parts past them are empty (torch.chunk's rounding leaves the
        last ranks none of a tensor of few rows). ``whole``: 1."""
        if self.kind == WHOLE:
            return 1
        if any(s <= 0 for s in size):
            return 0
        return min(self.parts, -(-size[self.dim] // self._step(size)))

    def chunk(self, size: Sequence[int], rank: int) -> Box | None:
        """``(offsets, sizes)`` of the chunk ``rank`` holds of a tensor of ``size``;
        None when it holds none (a rank past ``parts``). A part past the tensor's end
        is an empty chunk at its end, where DTensor puts it. ``whole``: the whole
        tensor, for every rank."""
        zeros = (0,) * len(size)
        if self.kind == WHOLE:
            return zeros, tuple(size)
        if not 0 <= rank < self.parts:
            return None
        n, step = size[self.dim], self._step(size)
        start = min(n, rank * step)
        offsets, sizes = list(zeros), list(size)
        offsets[self.dim], sizes[self.dim] = start, max(0, min(step, n - start))
        return tuple(offsets), tuple(sizes)

    def holders(self, size: Sequence[int], offsets: Sequence[int],
                sizes: Sequence[int]) -> range:
        """The saved ranks whose (non-empty) chunk overlaps the box ``offsets``/
        ``sizes`` of a tensor of ``size``: the ranks whose records a load of that box
        reads. ``whole``: none, as its location is in the index, not in any records."""
        if self.kind == WHOLE or any(s <= 0 for s in sizes) or any(s <= 0 for s in size):
            return range(0)
        step = self._step(size)
        first = offsets[self.dim] // step
        last = (min(offsets[self.dim] + sizes[self.dim], size[self.dim]) - 1) // step
        return range(min(first, self.parts), min(last + 1, self.parts))

    def to_json(self) -> list[Any]:
        return [WHOLE] if self.kind == WHOLE else [CHUNKED, self.dim, self.parts]

    @staticmethod
    def from_json(doc: Any, ndim: int | None = None) -> Rule:
        """The rule ``doc`` (from :meth:`to_json`), read as hostile input: anything
        malformed, or a dim past ``ndim``, is a :class:`CorruptCheckpointError`."""
        if doc == [WHOLE]:
            return Rule(WHOLE)
        if (isinstance(doc, list) and len(doc) == 3 and doc[0] == CHUNKED
                and all(type(v) is int for v in doc[1:]) and doc[1] >= 0 and doc[2] >= 1
                and (ndim is None or doc[1] < ndim)):
            return Rule(CHUNKED, doc[1], doc[2])
        raise CorruptCheckpointError(f"malformed sharding rule {doc!r} in the DCP index; "
                                     "the checkpoint cannot be trusted", {"rule": repr(doc)})


def infer_rule(size: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
               rank: int, world: int) -> Rule | None:
    """The rule under which rank ``rank`` of ``world`` holds the chunk ``offsets``/
    ``sizes`` of a tensor of ``size``, judged from that chunk alone; None when no
    rule fits (irregular). A chunk that is the whole tensor is ``whole``; a rank
    of a ``chunked`` split holding the whole tensor (a dim of one row) reads as
    ``whole`` too, and the ranks' disagreement sends the save down the classic path."""
    if not (len(size) == len(offsets) == len(sizes)) or not 0 <= rank < world:
        return None
    if any(s < 0 for s in size) or any(o < 0 for o in offsets) or any(s < 0 for s in sizes):
        return None
    differs = [d for d in range(len(size)) if offsets[d] != 0 or sizes[d] != size[d]]
    if not differs:
        return Rule(WHOLE)
    if 0 in size:
        return None
    empty = [d for d in differs if sizes[d] == 0]
    if len(empty) > 1 or (not empty and len(differs) != 1):
        return None
    dim = empty[0] if empty else differs[0]
    if any(sizes[d] != size[d] for d in range(len(size)) if d != dim):
        return None
    rule = Rule(CHUNKED, dim, world)
    expected = rule.chunk(size, rank)
    assert expected is not None
    if sizes[dim] == 0:  # an empty part: where it sits holds nothing
        return rule if expected[1][dim] == 0 and offsets[dim] <= size[dim] else None
    return rule if (tuple(offsets), tuple(sizes)) == expected else None


def owner(fqn: str, world: int) -> int:
    """The rank that writes the item ``fqn`` held by every rank (a ``whole`` tensor,
    a non-tensor value): a hash of its name, so every rank knows without asking and
    replicated items spread over the ranks."""
    return zlib.crc32(fqn.encode()) % world
