"""Whether a bucket keeps what cloudckpt deletes: asked once per bucket and process.

On a bucket with versioning (S3, GCS), a delete only hides an object: its data stays
as a noncurrent version, billed, until a lifecycle rule expires it. cloudckpt deletes
through the current names only (``rm``, ``gc``, retention), so it says what stays:
the backend's ``bucket_versioning`` primitive is asked once per bucket and process
(cached under the backend's ``cache_key``, as the conditional-write probe is), and
:func:`what_stays` gives the sentence a command prints, :func:`log_once` the WARNING
a library delete logs the first time per bucket (a run's retention: once, not at
every save).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cloudckpt.util.perkey import OncePerKey

if TYPE_CHECKING:
    from cloudckpt.storage.store import Store

log = logging.getLogger(__name__)

#: What ``Backend.bucket_versioning`` answers: versions kept; kept no longer (those
#: made while it was on stay); never kept (or nothing to keep them: a local disk);
#: cannot be told (no permission, a service without the API).
ENABLED, SUSPENDED, OFF, UNKNOWN = "enabled", "suspended", "off", "unknown"

_STAYS = {
    ENABLED: "the bucket keeps versions (versioning enabled): their noncurrent versions "
             "stay and are billed until a lifecycle rule expires them",
    SUSPENDED: "the bucket's versioning is suspended: versions of them made while it was "
               "enabled stay and are billed until a lifecycle rule expires them",
}

_results: OncePerKey[str] = OncePerKey()
_told: OncePerKey[bool] = OncePerKey()  # buckets whose "what stays" was said


def status(store: Store) -> str:
    """The versioning of ``store``'s bucket (:data:`ENABLED`, ...), asked once per
    bucket and process; a question that fails is :data:`UNKNOWN` (never an error:
    it only decides what a delete says)."""
    key = store.backend.cache_key(store.root)
    known = _results.get(key)
    if known is not None:
        return known
    try:
        answer = store.retry.call(lambda: store.backend.bucket_versioning(store.root),
                                  op="get versioning", key=store.bucket_uri(),
                                  errors=store.backend)
    except Exception as exc:  # noqa: BLE001 - the delete it describes stands as done
        log.debug("cannot tell whether %s keeps versions: %s", store.bucket_uri(), exc)
        answer = UNKNOWN
    return _results.settle(key, answer)[0]


def what_stays(store: Store) -> str | None:
    """What of the objects deleted from ``store`` stays billed in its bucket, as a
    clause to follow "deleted ...; ", or None (nothing stays, or it cannot be told).
    Whoever asks says it: :func:`log_once` does not repeat it for that bucket."""
    stays = _STAYS.get(status(store))
    if stays is not None:
        _told.settle(store.backend.cache_key(store.root), True)
    return stays


def log_once(store: Store, done: str) -> None:
    """A WARNING ``"<done>; <what stays>"`` the first time objects are deleted from
    ``store``'s bucket in this process, unless that was said already."""
    stays = _STAYS.get(status(store))
    if stays is None or not _told.settle(store.backend.cache_key(store.root), True)[1]:
        return
    log.warning("%s; %s (said once per bucket)", done, stays)


def forget() -> None:
    """Drop every cached answer and what was said (tests)."""
    _results.forget()
    _told.forget()
