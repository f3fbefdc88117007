"""The ``s3`` and ``gcs`` uploaders: each ``upload`` one part, committed atomically by
the last part (or :meth:`RollUploader.commit`), pruned by ``max_ckpt_to_keep``.

A multi-part checkpoint is complete or invisible, and never lost silently: it commits
only when its parts hold everything ROLL's resume reads (:mod:`.markers`), and one whose
parts stop arriving is reported as an ERROR at the next save and at ``wait``/``close``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar

from cloudckpt.core import blobs
from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.checkpoint import Checkpoint
from cloudckpt.core.manifest import FileEntry
from cloudckpt.errors import (
    CommitConflictError,
    ConfigError,
    IncompleteCheckpointError,
    StorageError,
)
from cloudckpt.integrations.roll import commits, membership, pipeline
from cloudckpt.integrations.roll.layout import PARTS_DIR, checkpoint_order
from cloudckpt.integrations.roll.openckpts import OpenCheckpoints
from cloudckpt.integrations.roll.resume import (
    default_download_dir,
    download_checkpoint,
    latest_committed,
    recorded_clusters,
)
from cloudckpt.integrations.roll.sending import send_files
from cloudckpt.integrations.roll.worker import (
    UNSAFE_PART_CHARS,
    attempt_from_env,
    default_part_id,
    local_files,
    remove_path,
    restore_staged,
    snapshot_dir,
)
from cloudckpt.names import MANIFEST_NAME
from cloudckpt.runtime.pending import run_in_background
from cloudckpt.storage import Store, open_store, schemes_like

log = logging.getLogger(__name__)

#: Torn checkpoints younger than this are never pruned (a save may be running).
DEFAULT_TORN_GRACE_SECONDS = 6 * 3600.0
#: A checkpoint that gets no new part for this long is reported as never committing.
DEFAULT_PARTS_TIMEOUT = 120.0


class RollUploader(OpenCheckpoints):
    """A ROLL uploader to an object store; see the module docstring for the protocol.

    Options (keys of ``checkpoint_config``; unknown keys are ignored, ``type``
    included, so ``cls(**checkpoint_config)`` works as ROLL calls it):

    - ``output_dir``: ``s3://bucket/prefix`` or ``gs://bucket/prefix`` (no
      timestamp is appended, unlike ``file_system``);
    - ``async_upload`` (True): upload on a background thread. Each checkpoint
      stands alone: a failure is logged as an ERROR naming the checkpoint (ROLL's
      manager would swallow an exception anyway) and raised by ``wait()`` or by
      ``commit`` of that checkpoint, never by a later ``upload``;
    - ``keep_local_file`` (False): ROLL's key for its manager, which deletes the local
      copy once ``upload`` returns. A synchronous upload leaves the copy to it (had it
      deleted it first, ROLL's own ``os.remove`` would fail and log "upload failed"
      for an upload that succeeded); a background one deletes it after its upload,
      in case ROLL's manager did not, and puts it back if the upload fails;
    - ``expected_uploads``: parts per checkpoint (pipeline + every uploading rank), an
      override; without it each part declares its set, the pipeline's naming ROLL's
      pipeline's checkpoint clusters (:mod:`.membership`), and the part that completes
      the checkpoint commits it. Either way only once the parts hold all ROLL's resume
      reads;
    - ``parts_timeout`` (120 s): a checkpoint this process uploaded a part of that
      then gets no new part for this long is reported as an ERROR (at the next
      ``upload``, or by ``wait``/``close``, which wait that long at most);
    - ``max_ckpt_to_keep`` (0 = all): committed checkpoints kept in the bucket;
    - ``torn_grace_seconds`` (6 h): torn checkpoints younger than this are never pruned;
    - ``attempt_id``: an id shared by all processes of one launch (default:
      ``CLOUDCKPT_ATTEMPT_ID``, else the Ray cluster's session and job id, else none:
      parts written before this uploader was created are then taken as a crashed
      attempt's);
    - ``part_id``: this process's part name (default: the worker directory name);
    - ``download_dir``: where ``get_latest_ckpt`` downloads the latest committed
      checkpoint (default: a directory per ``output_dir`` in cloudckpt's cache);
    - ``storage_options``: passed to the store (endpoint, credentials, retry).
    """

    schemes: ClassVar[tuple[str, ...]] = ()
    type_name: ClassVar[str] = ""

    def __init__(
        self,
        output_dir: str,
        *,
        async_upload: bool = True,
        keep_local_file: bool = False,
        expected_uploads: int | None = None,
        max_ckpt_to_keep: int = 0,
        torn_grace_seconds: float = DEFAULT_TORN_GRACE_SECONDS,
        parts_timeout: float = DEFAULT_PARTS_TIMEOUT,
        attempt_id: str | None = None,
        part_id: str | None = None,
        download_dir: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        incremental: bool | None = None,
        **kwargs: Any,
    ) -> None:
        kind = kwargs.pop("type", None)
        if kind is not None and kind != self.type_name:
            raise ConfigError(f"{type(self).__name__} is the {self.type_name!r} uploader, "
                              f"but checkpoint_config has type {kind!r}")
        if kwargs:
            log.debug("roll uploader: ignoring checkpoint_config keys %s", sorted(kwargs))
        self.output_dir = self._normalise(str(output_dir))
        self.async_upload = bool(async_upload)
        self.keep_local_file = bool(keep_local_file)
        if expected_uploads is not None and int(expected_uploads) < 1:
            raise ConfigError(f"expected_uploads must be >= 1, got {expected_uploads!r}")
        self.expected_uploads = int(expected_uploads) if expected_uploads is not None else None
        self.max_ckpt_to_keep = int(max_ckpt_to_keep or 0)
        self.torn_grace_seconds = float(torn_grace_seconds)
        self.parts_timeout = float(parts_timeout)
        self.attempt_id = str(attempt_id) if attempt_id else attempt_from_env()
        self.part_id = part_id
        self.storage_options = dict(storage_options or {})
        self.download_dir = Path(download_dir or default_download_dir(self.output_dir))
        self.store: Store = open_store(self.output_dir, self.storage_options)
        self.store.check_bucket()  # before training starts, not at the first save
        #: Each file a blob of the output directory's area (None: $CLOUDCKPT_INCREMENTAL).
        self.blobs = BlobArea(self.store) if blobs.requested(incremental) else None
        self._created = time.time()
        self._uploaded = False
        #: ROLL's pipeline building this uploader (its driver's), or None: its part then
        #: names every checkpoint cluster the pipeline has (:mod:`.pipeline`).
        self._pipeline = pipeline.constructing() if self.expected_uploads is None else None
        #: The clusters the newest committed checkpoint was made of (then those of each
        #: one this process commits): a later checkpoint without one of them is not whole.
        #: Read at the first commit without a count (:meth:`_known_clusters`).
        self._groups: set[str] | None = None
        self._lock = threading.Lock()
        self._pending: list[Future[Any]] = []
        self._failed: dict[str, BaseException] = {}  # ckpt_id -> its first failure
        self._open: dict[str, None] = {}  # uploaded a part, not yet seen committed
        self._lost: dict[str, str] = {}  # ckpt_id -> the ERROR that reported it
        self._one_at_a_time = threading.Lock()  # background uploads go one by one
        log.info("ROLL checkpoints go to %s (%s upload, %s)", self.output_dir,
                 "async" if self.async_upload else "sync",
                 f"expected_uploads={self.expected_uploads}" if self.expected_uploads
                 else "parts known from the job" + (
                     ", every checkpoint cluster named by ROLL's pipeline"
                     if self._pipeline is not None else ""))

    def _normalise(self, uri: str) -> str:
        if "://" not in uri:
            return f"{self.schemes[0]}://{uri.lstrip('/')}"
        scheme = uri.split("://", 1)[0]
        if scheme not in self.schemes:
            raise ConfigError(f"checkpoint_config type {self.type_name!r} needs an output_dir "
                              f"starting with {self.schemes[0]}://, got {uri!r}")
        return uri.rstrip("/")

    # ------------------------------------------------------------ ROLL API

    def upload(self, ckpt_id: str, local_state_path: str, **kwargs: Any) -> None:
        """Upload one worker's files of ``ckpt_id`` as one part (and commit when
        it is the last expected part). Every call stands alone: an earlier
        checkpoint's failure never stops this one. A synchronous failure is logged
        and raised (ROLL's manager logs it and keeps the local copy)."""
        src = Path(local_state_path)
        part = UNSAFE_PART_CHARS.sub("_", str(kwargs.get("part_id") or self.part_id or
                                              default_part_id(ckpt_id, str(src))))
        store = self._checkpoint_store(ckpt_id)  # validates the name now, not in the thread
        if not self._uploaded:  # what is left open at process end is reported then
            self._uploaded = True
            atexit.register(self._exiting)
        if self.expected_uploads is None:
            membership.announce(store, part, self.attempt_id)
        # The pipeline's clusters as they are at its upload: after their do_checkpoint.
        clusters = (pipeline.checkpoint_clusters(self._pipeline)
                    if self._pipeline is not None else None)
        if not self.async_upload:
            try:
                self._upload_part(ckpt_id, src, part, src, clusters)
            except Exception as exc:
                self._report_failure(ckpt_id, part, exc, src)
                raise
            return
        staging = snapshot_dir(src)

        def background() -> None:
            with self._one_at_a_time:
                self._background(ckpt_id, staging, part, src, clusters)

        # Tracked like every background save: an upload still running when the process
        # ends is waited for (ROLL never calls wait()), or reported.
        fut = run_in_background(background, f"ROLL upload of {part} into "
                                f"{self.store.child(ckpt_id).uri}", name="cloudckpt-roll")
        with self._lock:
            self._pending.append(fut)

    def get_latest_ckpt(self) -> str | None:
        """Local directory holding the highest committed ``checkpoint-N`` (torn ones
        are skipped, each named in a WARNING with its parts found and expected),
        downloaded into ``download_dir`` with every file checked; None when the bucket
        has none. Local, because ROLL hands this value to ``download_model``, which
        returns a local directory unchanged and sends anything else to a model hub."""
        uri = self.latest_uri()
        if uri is None:
            return None
        return download_checkpoint(uri, self.download_dir, self.storage_options)

    def latest_uri(self) -> str | None:
        """URI of the highest committed ``checkpoint-N`` in the bucket, or None; a
        WARNING names each newer uncommitted one skipped."""
        best = latest_committed(self.store, self.expected_uploads)
        return None if best is None else self.store.child(best).uri

    # --------------------------------------------------------- cloudckpt API

    def commit(self, ckpt_id: str, expected_uploads: int | None = None,
               timeout: float = 600.0) -> str:
        """Commit ``ckpt_id`` from the parts present (waiting up to ``timeout``
        seconds for ``expected_uploads`` of them, when given, holding all that ROLL's
        resume reads). Returns its URI. Raises if this process's upload of
        ``ckpt_id`` failed (other checkpoints' failures do not matter here), and
        :class:`IncompleteCheckpointError` saying what is missing at the timeout."""
        self._drain()
        with self._lock:
            err = self._failed.pop(ckpt_id, None)
        if err is not None:
            raise StorageError(f"{self.store.child(ckpt_id).uri}: a part of this checkpoint "
                               f"failed to upload, so it cannot be committed: {err}") from err
        deadline = time.monotonic() + timeout
        while True:
            result = self._try_commit(ckpt_id, expected_uploads or 1)
            if isinstance(result, Checkpoint):
                self._forget(ckpt_id)
                return result.uri
            if time.monotonic() >= deadline:
                raise IncompleteCheckpointError(
                    f"{self.store.child(ckpt_id).uri} is not committed after {timeout:.0f} s: "
                    f"{result}. Fix: commit it once every part of it (the pipeline's and "
                    "every uploading rank's) is uploaded; a local checkpoint-N must hold "
                    "them all")
            time.sleep(0.2)

    def wait(self) -> None:
        """Wait for background uploads and for the checkpoints they went into to commit
        (up to ``parts_timeout`` after their latest part); then raise one error naming
        every checkpoint whose upload failed or that never got all its parts since the
        last ``wait`` (each was logged as an ERROR when found)."""
        self._drain()
        self._settle()
        with self._lock:
            failed, self._failed = self._failed, {}
            lost, self._lost = self._lost, {}
        if failed:
            names = ", ".join(sorted(failed, key=checkpoint_order))
            first = next(iter(failed.values()))
            also = (f"; and {', '.join(sorted(lost, key=checkpoint_order))} never got "
                    "all their parts" if lost else "")
            raise StorageError(f"background upload of {names} to {self.output_dir} failed "
                               f"(not committed; later checkpoints were not affected): "
                               f"{first}{also}") from first
        if lost:
            steps = sorted(lost, key=checkpoint_order)
            raise IncompleteCheckpointError(
                f"{', '.join(steps)} never committed to {self.output_dir}: not all their parts "
                f"arrived. {lost[steps[-1]]}")

    close = wait

    # ------------------------------------------------------------- internals

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fut in pending:
            fut.exception()

    def _background(self, ckpt_id: str, staging: Path, part: str, original: Path,
                    clusters: Mapping[str, int] | None) -> None:
        try:
            self._upload_part(ckpt_id, staging, part, original, clusters)
        except BaseException as exc:
            with self._lock:
                self._failed.setdefault(ckpt_id, exc)
            self._report_failure(ckpt_id, part, exc, restore_staged(staging, original))
            return
        remove_path(staging)

    def _report_failure(self, ckpt_id: str, part: str, exc: BaseException,
                        local: Path) -> None:
        """One ERROR line that says which checkpoint is lost, what still holds, and the fix
        (and no second one later about its missing parts)."""
        self._forget(ckpt_id)
        where = f"its files stay at {local}" if local.exists() else "no local copy is left"
        log.error(
            "%s was NOT saved to %s: uploading part %r failed for good: %s. The previous "
            "committed checkpoint stays the latest, and later checkpoints upload on their "
            "own. Fix: check the bucket, credentials and endpoint (storage_options), or "
            "raise storage_options.retry.deadline if the store was throttling; %s.",
            ckpt_id, self.output_dir, part, exc, where)

    def _checkpoint_store(self, ckpt_id: str) -> Store:
        if not isinstance(ckpt_id, str) or "/" in ckpt_id.strip("/") or not ckpt_id.strip("/"):
            raise ConfigError(f"ckpt_id must be one path component like 'checkpoint-100', "
                              f"got {ckpt_id!r}")
        return self.store.child(ckpt_id.strip("/"))

    def _upload_part(self, ckpt_id: str, src: Path, part: str, original: Path,
                     clusters: Mapping[str, int] | None = None) -> None:
        """Upload ``src`` as ``part``, its marker naming ``clusters`` (the pipeline's
        checkpoint clusters, each of which the checkpoint then needs), then commit if
        it is whole."""
        self._report_stalled(ckpt_id)
        store = self._checkpoint_store(ckpt_id)
        if store.exists(MANIFEST_NAME):
            raise CommitConflictError(
                f"{store.uri} is already committed (checkpoints are immutable); part {part!r} "
                "arrived after the commit: is expected_uploads too small?")
        files = local_files(src)
        t0 = time.monotonic()
        entries = send_files(store, files, self.blobs)
        marker = {"part": part, "attempt": self.attempt_id, "created": time.time(),
                  "host": socket.gethostname(), "pid": os.getpid(), "files": entries,
                  **membership.declare(part, clusters=clusters)}
        store.put(f"{PARTS_DIR}/{part}.json", json.dumps(marker, sort_keys=True).encode())
        log.info("uploaded part %r of %s: %d files, %d bytes in %.1f s", part, store.uri,
                 len(entries), sum(e["size"] for e in entries.values()), time.monotonic() - t0)
        result = self._try_commit(ckpt_id, self.expected_uploads)
        if isinstance(result, Checkpoint):
            self._forget(ckpt_id)
        else:
            with self._lock:
                self._open[ckpt_id] = None
        if not self.keep_local_file and original != src:  # a background upload's copy
            remove_path(original)

    def _current_parts(self, store: Store) -> dict[str, dict[str, Any]]:
        """The markers of this attempt's parts (see ``attempt_id``), by key."""
        return commits.current_parts(store, self.attempt_id, self._created)

    def _gaps(self, store: Store, parts: Mapping[str, Mapping[str, Any]],
              expected: int | None) -> list[str]:
        """Without a count: what the parts' declared sets still miss (and the clusters a
        committed checkpoint recorded)."""
        if expected is not None:
            return []
        return membership.missing(parts, membership.announced(store, self.attempt_id,
                                                              self._created),
                                  self._known_clusters())

    def _known_clusters(self) -> set[str]:
        """:attr:`_groups`, read from the bucket the first time: a listing, which
        neither a count nor a process that never commits needs."""
        if self._groups is None:
            self._groups = recorded_clusters(self.store)
        return self._groups

    def _try_commit(self, ckpt_id: str, expected: int | None) -> Checkpoint | str:
        """Commit ``ckpt_id`` if its current parts are all in (``expected`` of them, or
        as they declare) and hold all ROLL's resume reads; else say why not."""
        store = self._checkpoint_store(ckpt_id)
        parts = self._current_parts(store)
        files = commits.ready(store, parts, expected, self._gaps(store, parts, expected))
        return files if isinstance(files, str) else self._commit(store, ckpt_id, parts, files)

    def _commit(self, store: Store, ckpt_id: str, parts: Mapping[str, Mapping[str, Any]],
                files: Mapping[str, FileEntry]) -> Checkpoint:
        ckpt = commits.commit(store, ckpt_id, parts, files, self.attempt_id)
        self._known_clusters().update(str(m["group"]) for m in parts.values() if "group" in m)
        try:
            self._prune()
        except StorageError as exc:  # the checkpoint is committed; pruning retries next time
            log.warning("committed %s, but pruning %s failed: %s", store.uri, self.output_dir,
                        exc)
        return ckpt

    def _progress(self, ckpt_id: str) -> commits.Progress | None:
        """Where an open checkpoint stands; None once committed (here, if its parts are
        complete now, as this process counts them), or gone (pruned)."""
        store = self._checkpoint_store(ckpt_id)
        if store.exists(MANIFEST_NAME):
            return None
        parts = self._current_parts(store)
        if not parts:  # committed and cleaned up meanwhile, or pruned
            return None
        state = commits.assess(store, parts, self.expected_uploads,
                               self._gaps(store, parts, self.expected_uploads))
        if isinstance(state, commits.Progress):
            return state
        self._commit(store, ckpt_id, parts, state)
        return None

    def _prune(self) -> None:
        commits.prune(self.store, self.max_ckpt_to_keep, self.torn_grace_seconds,
                      self.storage_options)


class S3Uploader(RollUploader):
    """``checkpoint_config: {type: s3, output_dir: s3://bucket/prefix}``."""

    schemes = schemes_like("s3")
    type_name = "s3"


class GcsUploader(RollUploader):
    """``checkpoint_config: {type: gcs, output_dir: gs://bucket/prefix}``."""

    schemes = schemes_like("gs")
    type_name = "gcs"
