"""Before training starts: the trial's bucket exists and answers, the trial is not
one AReaL wrote itself, and a run that would not resume does not start over a trial
that can be resumed.

Without these checks a misspelt bucket reads as an empty trial ("starting from
scratch") and the run dies at its first save; a trial copied into the bucket with
``aws s3 sync`` (AReaL's layout, no cloudckpt manifests) is ignored: the run starts over
beside it; and a relaunch without ``recover.mode`` trains from scratch beside the
trial's last dump, its exports kept from the run before. All are refused here, at
construction, with what to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cloudckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
)
from cloudckpt.integrations.areal.layout import INFO_DIR, save_root
from cloudckpt.names import SLOT_POINTER_NAME
from cloudckpt.storage import Store, open_store

ADOPT_HINT = "cloudckpt areal adopt"


def _prefixes(store: Store, config: Any) -> list[str]:
    """The trial directory's sub-prefixes; a missing bucket or refused credentials
    raise, naming the config key that points there."""
    key = f"{type(config).__name__}.fileroot"
    try:
        names = store.list_prefixes()
        if not names:
            store.check_bucket()  # an empty listing cannot tell a missing bucket
        return names
    except BucketNotFoundError as exc:
        raise BucketNotFoundError(
            f"{key} is {config.fileroot!r}, but {exc}. Nothing has been trained yet: create "
            "the bucket, or correct fileroot (usually cluster.fileroot) in the saver: and "
            "recover: sections, then launch again") from exc
    except AccessDeniedError as exc:
        raise AccessDeniedError(
            f"cannot read the trial directory {store.uri} ({key} is {config.fileroot!r}): "
            f"{exc}. Nothing has been trained yet: fix the credentials (AWS_* or "
            "GOOGLE_APPLICATION_CREDENTIALS variables, ~/.aws, the instance role) or "
            "storage_options=, then launch again") from exc


def check_trial(config: Any, storage_options: Mapping[str, Any] | None, *,
                recover: bool) -> None:
    """Raise unless the trial directory of ``config`` is reachable and, for the
    ``recover`` handler, holds no recover state AReaL wrote itself that cloudckpt
    would not resume (call on one rank; the caller shares the outcome)."""
    store = open_store(save_root(config), storage_options)
    names = _prefixes(store, config)
    if recover and INFO_DIR in names and not store.exists(SLOT_POINTER_NAME):
        raise IncompleteCheckpointError(
            f"{store.uri} holds a trial AReaL wrote itself ({INFO_DIR}/ and no cloudckpt "
            "manifest, e.g. copied with `aws s3 sync`); resuming would ignore it and train "
            f"from scratch. Check and commit it once with `{ADOPT_HINT} {store.uri}`, then "
            "launch again (or set a new trial_name to start afresh)")


def refuse_fresh_start(config: Any, storage_options: Mapping[str, Any] | None) -> None:
    """Raise if the trial holds a committed recover dump that this run, its recover
    mode off, would train from scratch beside (call on one rank)."""
    store = open_store(save_root(config), storage_options)
    if store.exists(SLOT_POINTER_NAME):
        raise ConfigError(
            f"{store.uri} holds a committed recover dump of this trial, and recover.mode is "
            f"{config.mode!r}: this run would start over beside it. Set recover.mode: on to "
            "resume from it, or set a new trial_name to start afresh (or delete the trial: "
            f"cloudckpt rm {store.uri}), then launch again")
