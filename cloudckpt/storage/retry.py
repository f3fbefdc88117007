"""Retries with exponential backoff and jitter, bounded in attempts and time.

One policy serves every backend. Transient failures (throttling, 5xx,
connection resets, timeouts) are retried; anything else fails at once with a
:class:`~cloudckpt.errors.StorageError` that says what to check. Missing
objects are not failures of the store: ``FileNotFoundError`` passes through
untouched so callers can turn it into their own error.

What a failure *is* comes in two halves. The rules here know what any Python
HTTP or file client raises (connection errors, timeouts, errnos, an aiohttp
response's status). What only a backend knows (its SDK's error codes, how it
reports a status or missing credentials) it says itself: every function below
takes the backend as ``errors``, something with ``classify(exc)`` returning a
:class:`Classified` for one exception of a chain (None: nothing to say). With
no backend named, the rules the registry collected from the built-in backends
apply (:func:`add_fallback`).
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar
from urllib.parse import quote, quote_plus

import tenacity

from cloudckpt.errors import (
    AccessDeniedError,
    CloudCkptError,
    ConfigError,
    DiskFullError,
    StorageError,
)
from cloudckpt.storage.transfer.stopping import check_stop
from cloudckpt.storage.transfer.tally import count_attempt

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_TRANSIENT_ERRNO = {errno.EBUSY, errno.EREMOTEIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET}
#: Generic HTTP clients whose connection failures are named, not typed, alike.
_HTTP_CLIENTS = ("aiohttp", "urllib3", "requests")
_CONNECTION_WORDS = ("Connection", "Timeout", "Payload", "Disconnected", "IncompleteRead",
                     "ReadTimeout", "ProxyError")


class Failure(enum.Enum):
    """What a backend knows one of its failures to be, beyond its HTTP status."""

    #: Worth retrying, whatever the status says (throttling by code, a dropped
    #: connection, a token service's hiccup behind a 401).
    TRANSIENT = "transient"
    #: Refused for the credentials or the permissions they carry.
    DENIED = "denied"
    #: No credentials were found, so no request was sent.
    NO_CREDENTIALS = "no credentials"
    #: The object (or bucket) does not exist: raised as ``FileNotFoundError``.
    NOT_FOUND = "not found"
    #: Refused by the client before sending (a malformed bucket name or option):
    #: raised as :class:`~cloudckpt.errors.ConfigError`.
    INVALID = "invalid"


@dataclass(frozen=True)
class Classified:
    """A backend's word on one exception of a failure's chain."""

    #: What it is, where the status alone does not tell (None: the generic rules decide).
    failure: Failure | None = None
    #: The HTTP status behind it, if the backend knows one.
    status: int | None = None
    #: The service's error code (``"SlowDown"``), for messages.
    code: str | None = None
    #: What to do about it, in the backend's words (said for ``NO_CREDENTIALS``).
    hint: str | None = None


class Classifier(Protocol):
    """Anything that classifies its own exceptions: every backend."""

    def classify(self, exc: BaseException) -> Classified | None: ...


_fallback: list[Callable[[BaseException], Classified | None]] = []


def add_fallback(classify: Callable[[BaseException], Classified | None]) -> None:
    """Have ``classify`` judge failures whose backend is not named (the registry adds
    the built-in backends' rules, so ``is_transient(exc)`` knows S3's and GCS's
    errors wherever they come from)."""
    if classify not in _fallback:
        _fallback.append(classify)


def _classify(e: BaseException, errors: Classifier | None) -> Classified | None:
    if errors is not None:
        return errors.classify(e)
    for classify in _fallback:
        verdict = classify(e)
        if verdict is not None:
            return verdict
    return None


def _verdicts(exc: BaseException, errors: Classifier | None) -> list[Classified]:
    return [v for e in _chain(exc) if (v := _classify(e, errors)) is not None]


def failures(exc: BaseException, errors: Classifier | None = None) -> set[Failure]:
    """Every :class:`Failure` the backend sees in ``exc``'s chain."""
    return {v.failure for v in _verdicts(exc, errors) if v.failure is not None}


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try before a storage operation is declared failed.

    ``deadline`` bounds the total time of one operation, retries included;
    ``max_attempts`` bounds the number of tries.
    """

    max_attempts: int = 8
    initial_backoff: float = 0.2
    max_backoff: float = 10.0
    deadline: float = 120.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("RetryPolicy.max_attempts must be >= 1")
        if self.deadline <= 0 or self.initial_backoff < 0 or self.max_backoff < 0:
            raise ValueError("RetryPolicy times must be positive")

    def call(self, fn: Callable[[], T], *, op: str, key: str,
             errors: Classifier | None = None) -> T:
        """Run ``fn`` under this policy; ``op`` and ``key`` name it in logs and errors,
        and ``errors`` (the backend) classifies what it raises."""
        start = time.monotonic()
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts)
            | tenacity.stop_after_delay(self.deadline),
            wait=tenacity.wait_random_exponential(
                multiplier=self.initial_backoff, max=self.max_backoff
            ),
            retry=tenacity.retry_if_exception(lambda exc: is_transient(exc, errors)),
            before_sleep=lambda rs: _log_retry(rs, op, key, self.max_attempts, errors),
            reraise=True,
        )

        tries = 0

        def attempt() -> T:
            nonlocal tries
            check_stop()  # a failed or interrupted batch starts no more requests
            count_attempt(retry=tries > 0)
            tries += 1
            return fn()

        try:
            return retrying(attempt)
        except (CloudCkptError, FileNotFoundError, FileExistsError, EOFError):
            raise
        except Exception as exc:  # noqa: BLE001 - every other failure is a storage failure
            verdict = _classify(exc, errors)
            failure = verdict.failure if verdict is not None else None
            if failure is Failure.INVALID:  # refused by the client, before sending
                raise ConfigError(f"{op} {key}: {describe(exc, errors)}; check the URI (bucket "
                                  "name) and the storage options") from exc
            if failure is Failure.NOT_FOUND:
                raise FileNotFoundError(f"{key}: {describe(exc, errors)}") from exc
            raise _storage_error(exc, op, key, time.monotonic() - start, errors) from exc


#: One attempt, bounded: for clean-ups after a failure, which must not hide it.
ONE_TRY = RetryPolicy(max_attempts=1, deadline=10.0)


def _log_retry(state: tenacity.RetryCallState, op: str, key: str, max_attempts: int,
               errors: Classifier | None) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning(
        "retrying %s %s after attempt %d/%d failed: %s (sleeping %.2fs)",
        op,
        key,
        state.attempt_number,
        max_attempts,
        describe(exc, errors),
        state.next_action.sleep if state.next_action else 0.0,
    )


def _storage_error(exc: BaseException, op: str, key: str, elapsed: float,
                   errors: Classifier | None) -> StorageError:
    return storage_error(exc, f"{op} {key}", f"after {elapsed:.1f}s", errors)


def storage_error(exc: BaseException, what: str, when: str = "",
                  errors: Classifier | None = None) -> StorageError:
    """The cloudckpt error for a failure of ``what`` (e.g. ``"put s3://b/k"``): its
    class and hint say what to check, by what the failure was."""
    cause = describe(exc, errors)
    failed = f"{what} failed{' ' + when if when else ''}: {cause}"
    verdicts = _verdicts(exc, errors)
    for v in verdicts:
        if v.failure is Failure.NO_CREDENTIALS:
            hint = v.hint or "Configure the credentials of the store"
            return AccessDeniedError(
                f"{what}: no credentials were found, so no request was sent ({cause}). {hint}")
    if any(isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNO for e in _chain(exc)):
        return DiskFullError(
            f"{failed}; the local disk is full, a quota is reached, or a file exceeds the "
            "file size limit (ulimit -f). Free space, or write somewhere else")
    if is_transient(exc, errors):
        hint = ("the store kept failing with transient errors; check that the endpoint is "
                "reachable and not throttling, or raise RetryPolicy.deadline/max_attempts")
    elif (status_of(exc, errors) in (401, 403) or isinstance(exc, PermissionError)
          or any(v.failure is Failure.DENIED for v in verdicts)):
        return AccessDeniedError(f"{failed}; access was denied; check the credentials and "
                                 "the bucket's permissions")
    elif _unreachable(exc):
        hint = "the endpoint cannot be reached; check the endpoint URL and the network"
    else:
        hint = "the store refused the request; check the URI, bucket and storage options"
    return StorageError(f"{failed}; {hint}")


_DISK_FULL_ERRNO = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _unreachable(exc: BaseException) -> bool:
    # aiohttp's ClientConnectorError and ClientConnectorDNSError, and their like.
    return any("DNS" in type(e).__name__ or "Connector" in type(e).__name__
               for e in _chain(exc))


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def status_of(exc: BaseException, errors: Classifier | None = None) -> int | None:
    """The HTTP status behind an error (the backend's word, or an aiohttp
    response's status), if any."""
    for e in _chain(exc):
        verdict = _classify(e, errors)
        if verdict is not None and verdict.status is not None:
            return verdict.status
        status = getattr(e, "status", None)  # aiohttp ClientResponseError
        if isinstance(status, int) and 100 <= status < 600:
            return status
    return None


def _error_code(exc: BaseException, errors: Classifier | None) -> str | None:
    return next((v.code for v in _verdicts(exc, errors) if v.code), None)


def is_transient(exc: BaseException, errors: Classifier | None = None) -> bool:
    """True for failures worth retrying: throttling, 5xx, resets, timeouts."""
    if isinstance(exc, (CloudCkptError, FileNotFoundError, FileExistsError, PermissionError,
                        EOFError)):
        return False
    said = failures(exc, errors)
    if Failure.TRANSIENT in said:
        return True
    if said:  # denied, no credentials, not found, invalid: retrying changes nothing
        return False
    status = status_of(exc, errors)
    if status is not None:
        return status in _TRANSIENT_STATUS
    for e in _chain(exc):
        if isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        if type(e).__module__.split(".")[0] in _HTTP_CLIENTS:
            name = type(e).__name__
            if any(w in name for w in _CONNECTION_WORDS):
                return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO:
            return True
    return False


def mask_secrets(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret replaced by ``***``, as is and URL-encoded; the
    longest first, so none is left half-masked by a shorter one inside it."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        for form in (secret, quote_plus(secret), quote(secret, safe="")):
            text = text.replace(form, "***")
    return text


def describe(exc: BaseException | None, errors: Classifier | None = None) -> str:
    """A one-line description of an error, with its HTTP status and code when known."""
    if exc is None:
        return "unknown error"
    parts = [type(exc).__name__]
    status, code = status_of(exc, errors), _error_code(exc, errors)
    if status:
        parts.append(f"HTTP {status}")
    if code:
        parts.append(code)
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{' '.join(parts)}: {msg[:300]}" if msg else " ".join(parts)
