"""Framework integrations: each framework's keys and layout mapped onto cloudckpt.

One package per framework (``areal``, ``roll``, ``rlinf``, ``verl``); nothing is
re-implemented there, only translated. Each declares what the core must know of
it in its ``plugin`` module (:class:`cloudckpt.core.plugins.Framework`), named in
the ``cloudckpt.frameworks`` entry-point group.

What they share is the switch allowing a partial resume: a framework's config has no
place for cloudckpt's ``allow_partial``, so the environment carries it.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from cloudckpt.core.profiles import Profile, check_resume
from cloudckpt.errors import ConfigError

#: Set to 1 to let an integration resume from a partial save (a ``weights`` or
#: ``adapters`` profile) where the framework's own options would load what it lacks.
ALLOW_PARTIAL_ENV = "CLOUDCKPT_ALLOW_PARTIAL_RESUME"


def partial_allowed() -> bool:
    """Whether ``$CLOUDCKPT_ALLOW_PARTIAL_RESUME`` allows a partial resume."""
    value = os.environ.get(ALLOW_PARTIAL_ENV, "").strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes"):
        raise ConfigError(f"{ALLOW_PARTIAL_ENV}={value!r}: set it to 1 (allow a partial "
                          "resume) or 0")
    return value in ("1", "true", "yes")


def check_framework_resume(uri: str, profile: Profile, wanted: Collection[str], *,
                           framework_key: str) -> list[str]:
    """:func:`~cloudckpt.core.profiles.check_resume` for a framework's resume, allowed by
    :data:`ALLOW_PARTIAL_ENV`; ``framework_key`` says which of the framework's own
    options to change instead (``"leave 'optimizer' out of ...load_contents"``).
    Returns what starts fresh."""
    return check_resume(uri, profile, wanted, allow_partial=partial_allowed(),
                        how_to_allow=f"{framework_key}, or set {ALLOW_PARTIAL_ENV}=1")
