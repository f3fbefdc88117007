"""Whether a store honours conditional writes: probed once per bucket and process.

Every guarantee against racing writers rests on the server refusing a create-only
write of an existing key (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``) and
a compare-and-swap against a stale version. Many S3-compatible stores ignore the
headers (answering 200 and overwriting) or refuse them (501, 400). Before the first
conditional write to a bucket, :func:`supports` has the store try both on a probe
object with its backend's primitives (:func:`probe`: a few requests, once per
bucket and process). A store that fails is used in the emulated mode (check,
write, then read back after a settling delay), with one ERROR per bucket, or
refused (``conditional_writes="require"``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from cloudckpt.errors import CommitConflictError, ConfigError
from cloudckpt.names import TMP_PREFIX
from cloudckpt.storage.backend import Backend
from cloudckpt.storage.retry import status_of
from cloudckpt.util.crc import Buffer
from cloudckpt.util.perkey import OncePerKey

log = logging.getLogger(__name__)

#: What ``conditional_writes`` may be: refuse a store that does not honour them,
#: probe it (the default), or trust it without a probe.
MODES = ("require", "probe", "assume")
DEFAULT_MODE = "probe"
#: Probe results: both enforced; create-only enforced, compare-and-swap not; neither
#: (the headers let through, or refused with 501/400).
NATIVE, CREATE_ONLY, IGNORED, REFUSED = "native", "create-only", "ignored", "refused"
#: Emulated writes read back this long after writing: longer than any racing
#: writer may take from its check to the end of its write (see EMULATION_BOUND_S).
EMULATION_SETTLE_S = 2.0
#: An emulated write whose check-to-write took longer than this cannot tell whether
#: a racer read back its own bytes before ours landed; it reports a conflict.
EMULATION_BOUND_S = EMULATION_SETTLE_S / 2

_results: OncePerKey[str] = OncePerKey()


def check_mode(value: object) -> str:
    if value not in MODES:
        raise ConfigError(f"storage option conditional_writes must be one of {MODES}, "
                          f"got {value!r}")
    return str(value)


def supports(mode: str, key: tuple[str, ...], where: str, run_probe: Callable[[], str], *,
             swap: bool) -> bool:
    """Whether the server enforces create-only writes (or, with ``swap``,
    compare-and-swap) for a store in ``mode`` (its ``conditional_writes``): probed by
    ``run_probe`` (the store's :func:`probe`, under its retries) on first use per
    ``key`` (the backend's ``cache_key``: backend, options, bucket) and process
    (``probe``, ``require``), or trusted (``assume``). ``require`` on a store that
    does not enforce both: :class:`ConfigError` naming ``where`` (the bucket)."""
    if mode == "assume":
        return True
    result = _results.get(key)
    if result is None:
        result, first = _results.settle(key, run_probe())
        if first and result != NATIVE and mode != "require":
            log.error(
                "%s %s; cloudckpt emulates %s there (check, write, read back after %.1fs): "
                "safe for one writer per checkpoint, not proof against writers racing on one "
                "key. Use a store that honours them, or set conditional_writes='require' to "
                "refuse this one.", where, _what(result),
                "compare-and-swap" if result == CREATE_ONLY else "conditional writes",
                EMULATION_SETTLE_S)
    if result != NATIVE and mode == "require":
        raise ConfigError(
            f"{where} {_what(result)}, and conditional_writes='require' refuses "
            "such a store: nothing was written. Use a store that honours them, or "
            "conditional_writes='probe' to use it in the emulated mode.")
    return result == NATIVE or (result == CREATE_ONLY and not swap)


def _what(result: str) -> str:
    if result == CREATE_ONLY:
        return "enforces create-only writes but not compare-and-swap (If-Match)"
    verb = "ignores" if result == IGNORED else "refuses"
    return f"{verb} conditional writes (If-None-Match/If-Match)"


def probe_key() -> str:
    """A fresh key for a probe object (hidden: a leftover is bookkeeping gc removes)."""
    return f"{TMP_PREFIX}probe-{uuid.uuid4().hex[:16]}"


def probe(backend: Backend, path: str, cleanup: Callable[[], None], where: str) -> str:
    """One probe attempt (at most four requests) with ``backend``'s primitives: create
    the probe object ``path`` create-only, try again create-only (must be refused),
    try a compare-and-swap against the backend's ``probe_stale_version`` (must be
    refused), then ``cleanup()`` (the store deletes it, under its retries). A refusal
    with HTTP 501 or 400 (the header not implemented) means :data:`REFUSED`;
    ``where`` (the bucket) names the store in logs."""
    stale_version = backend.probe_stale_version
    if stale_version is None:
        return NATIVE  # local disk, memory: the writes cannot fail to be enforced

    def enforced(write: Callable[[], object]) -> bool | None:
        """True: refused as it must be; False: let through; None: header refused."""
        try:
            write()
        except FileExistsError:
            return True
        except Exception as exc:  # botocore's, gcsfs's HttpError (not an OSError)
            if status_of(exc, backend) in (400, 501):
                log.debug("conditional write refused on %s: %s", where, exc)
                return None
            raise
        return False

    try:
        if enforced(lambda: backend.put_if_absent(path, b"cloudckpt probe 1")) is None:
            return REFUSED  # (True: a stale probe of ours from a crash; the next tells)
        create_only = enforced(lambda: backend.put_if_absent(path, b"cloudckpt probe 2"))
        if not create_only:
            return IGNORED if create_only is False else REFUSED
        swap = enforced(lambda: backend.put_if_match(path, b"cloudckpt probe 3", stale_version))
        return NATIVE if swap else CREATE_ONLY
    finally:
        cleanup()


def forget() -> None:
    """Drop every cached probe result (tests)."""
    _results.forget()


def emulated_write(backend: Backend, path: str, data: Buffer,
                   current_ok: Callable[[str | None], bool]) -> str:
    """A conditional write on a store that does not enforce them: check the current
    version with ``current_ok`` (None: absent), write, wait, read back, all with
    ``backend``'s primitives. Raises ``FileExistsError`` when the check fails, the
    read-back shows another writer's bytes, or the write took too long to be sure."""
    start = time.monotonic()
    head = backend.head(path)
    if not current_ok(None if head is None else backend.version_of(head)):
        raise FileExistsError(path)
    backend.put(path, data)
    took = time.monotonic() - start
    time.sleep(EMULATION_SETTLE_S)
    current, version = backend.get_versioned(path)
    if bytes(current) != bytes(data):
        raise FileExistsError(path)  # a racer's write landed after ours: it won
    if took > EMULATION_BOUND_S:  # a racer may have read back its own bytes before ours
        raise CommitConflictError(
            f"the emulated conditional write of {path} took {took:.1f}s from check to write "
            f"(more than {EMULATION_BOUND_S:.1f}s): another writer may have committed first "
            "and been overwritten. Check the checkpoint (cloudckpt verify) before relying on it.")
    return version
