"""What to keep: the retention policy, and applying it to a run directory.

One policy for every saver (the manager, RLinf's ``keep_last``, ROLL's
``max_ckpt_to_keep``): keep the newest ``keep_last`` committed checkpoints and
every one whose number is a multiple of ``keep_every``. It governs only the
saver's own checkpoints (:class:`Managed`: its manifest kind and its naming),
never a user's checkpoint of another kind or name in the same root; those
neither count toward ``keep_last`` nor are deleted. Applying it deletes only
committed checkpoints (:func:`cloudckpt.core.deletion.delete_checkpoint`), and never
fails the save that triggered it: a delete that fails is logged and the
checkpoint stays for the next save to try again.
"""

from __future__ import annotations

import logging
import re
import string
from collections.abc import Callable, Collection
from dataclasses import dataclass

from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.core.listing import CheckpointInfo, list_checkpoints
from cloudckpt.errors import CloudCkptError
from cloudckpt.storage import Store

log = logging.getLogger(__name__)


def select_for_deletion(steps: list[int], keep_last: int | None,
                        keep_every: int | None = None) -> list[int]:
    """Which of ``steps`` (committed checkpoints' numbers) the policy drops."""
    if keep_last is None:
        return []
    newest = set(sorted(steps)[-keep_last:])
    return sorted(s for s in steps
                  if s not in newest and not (keep_every and s % keep_every == 0))


@dataclass(frozen=True)
class Managed:
    """Which checkpoints of a root a saver owns: manifest ``kind`` and names that
    ``pattern`` matches in full, its first group being the checkpoint's number.

    Calling it on a listing entry gives that number, or None for anything else
    (uncommitted, another kind, another name).
    """

    kind: str
    pattern: re.Pattern[str]

    @classmethod
    def from_format(cls, kind: str, name_format: str) -> Managed:
        """Names made by ``name_format.format(step=N)`` (e.g. ``"step-{step}"``)."""
        parts = [re.escape(literal) + (r"(\d+)" if field == "step" else "")
                 for literal, field, _, _ in string.Formatter().parse(name_format)]
        return cls(kind, re.compile("".join(parts)))

    def number(self, name: str) -> int | None:
        """The number in ``name`` when it is one of these names, else None."""
        m = self.pattern.fullmatch(name)
        return int(m.group(1)) if m else None

    def __call__(self, info: CheckpointInfo) -> int | None:
        if not info.committed or info.kind != self.kind:
            return None
        return self.number(info.name)


def apply_retention(store: Store, keep_last: int | None, keep_every: int | None = None, *,
                    number: Callable[[CheckpointInfo], int | None],
                    keep: str | Collection[str] = ()) -> list[str]:
    """Delete the committed checkpoints directly below ``store`` that the policy drops.

    ``number`` gives each checkpoint's number, or None for one the policy does
    not govern (a :class:`Managed` rule: another kind, or a name the saver does
    not make); ``keep`` names what is never deleted (the save just made). Returns
    the URIs deleted; failures are WARNINGs, never raised.
    """
    if keep_last is None:
        return []
    try:
        governed = [(n, c) for c in list_checkpoints(store) if (n := number(c)) is not None]
    except CloudCkptError as exc:
        log.warning("retention could not list %s (%s); the next save tries again",
                    store.uri, exc)
        return []
    spared = {keep} if isinstance(keep, str) else set(keep)
    # What is kept in their place must be there: the newest, when the listing took them
    # from the root index, are checked by their manifests (a HEAD each) first.
    while True:
        drop = set(select_for_deletion([n for n, _ in governed], keep_last, keep_every))
        newest = sorted(n for n, _ in governed)[-keep_last:] if keep_last else []
        gone = [c for n, c in governed if n in newest and c.name not in spared
                and not c.present(store)]
        if not gone:
            break
        governed = [(n, c) for n, c in governed if c not in gone]
    deleted = []
    for n, c in governed:
        if n not in drop or c.name in spared:
            continue
        try:
            delete_checkpoint(store.child(c.name))
        except CloudCkptError as exc:
            log.warning("retention could not delete %s (%s); it stays, the next save "
                        "tries again", c.uri, exc)
            continue
        log.info("retention: deleted %s (%s %d; keep_last=%s, keep_every=%s)", c.uri,
                 c.name, n, keep_last, keep_every)
        deleted.append(c.uri)
    return deleted
