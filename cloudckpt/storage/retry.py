"""Retries with exponential backoff and jitter, bounded in attempts and time.

One policy serves every backend. Transient failures (throttling, 5xx,
connection resets, timeouts) are retried; anything else fails at once with a
:class:`~cloudckpt.errors.StorageError` that says what to check. Missing
objects are not failures of the store: ``FileNotFoundError`` passes through
untouched so callers can turn it into their own error.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote, quote_plus

import tenacity

from cloudckpt.errors import (
    AccessDeniedError,
    CloudCkptError,
    ConfigError,
    DiskFullError,
    StorageError,
)
from cloudckpt.storage.stopping import check_stop

log = logging.getLogger("cloudckpt.storage")

T = TypeVar("T")

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestLimitExceeded",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "OperationAborted",
}
_TRANSIENT_ERRNO = {errno.EBUSY, errno.EREMOTEIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET}


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

    def call(self, fn: Callable[[], T], *, op: str, key: str) -> T:
        """Run ``fn`` under this policy; ``op`` and ``key`` name it in logs and errors."""
        start = time.monotonic()
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts)
            | tenacity.stop_after_delay(self.deadline),
            wait=tenacity.wait_random_exponential(
                multiplier=self.initial_backoff, max=self.max_backoff
            ),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=lambda rs: _log_retry(rs, op, key, self.max_attempts),
            reraise=True,
        )

        def attempt() -> T:
            check_stop()  # a failed or interrupted batch starts no more requests
            return fn()

        try:
            return retrying(attempt)
        except (CloudCkptError, FileNotFoundError, FileExistsError, EOFError):
            raise
        except Exception as exc:  # noqa: BLE001 - every other failure is a storage failure
            if type(exc).__name__ == "ParamValidationError":  # botocore, before sending
                raise ConfigError(f"{op} {key}: {describe(exc)}; check the URI (bucket "
                                  "name) and the storage options") from exc
            raise _storage_error(exc, op, key, time.monotonic() - start) from exc


def _log_retry(state: tenacity.RetryCallState, op: str, key: str, max_attempts: int) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning(
        "retrying %s %s after attempt %d/%d failed: %s (sleeping %.2fs)",
        op,
        key,
        state.attempt_number,
        max_attempts,
        describe(exc),
        state.next_action.sleep if state.next_action else 0.0,
    )


def _storage_error(exc: BaseException, op: str, key: str, elapsed: float) -> StorageError:
    return storage_error(exc, f"{op} {key}", f"after {elapsed:.1f}s")


def storage_error(exc: BaseException, what: str, when: str = "") -> StorageError:
    """The cloudckpt error for a failure of ``what`` (e.g. ``"put s3://b/k"``): its
    class and hint say what to check, by what the failure was."""
    cause = describe(exc)
    failed = f"{what} failed{' ' + when if when else ''}: {cause}"
    if _no_credentials(exc):
        return AccessDeniedError(
            f"{what}: no credentials were found, so no request was sent ({cause}). Set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws, an "
            "instance role), or pass the key and secret storage options")
    if any(isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNO for e in _chain(exc)):
        return DiskFullError(
            f"{failed}; the local disk is full, a quota is reached, or a file exceeds the "
            "file size limit (ulimit -f). Free space, or write somewhere else")
    if is_transient(exc):
        hint = ("the store kept failing with transient errors; check that the endpoint is "
                "reachable and not throttling, or raise RetryPolicy.deadline/max_attempts")
    elif status_of(exc) in (401, 403) or isinstance(exc, PermissionError):
        return AccessDeniedError(f"{failed}; access was denied; check the credentials and "
                                 "the bucket's permissions")
    elif _unreachable(exc):
        hint = "the endpoint cannot be reached; check the endpoint URL and the network"
    else:
        hint = "the store refused the request; check the URI, bucket and storage options"
    return StorageError(f"{failed}; {hint}")


_DISK_FULL_ERRNO = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _no_credentials(exc: BaseException) -> bool:
    # botocore raises these before any request is sent.
    return any(type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError")
               for e in _chain(exc))


def _unreachable(exc: BaseException) -> bool:
    return any("DNS" in type(e).__name__ or "Connector" in type(e).__name__
               or "EndpointConnectionError" == type(e).__name__ for e in _chain(exc))


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def status_of(exc: BaseException) -> int | None:
    """The HTTP status behind an error (botocore, gcsfs, aiohttp), if any."""
    for e in _chain(exc):
        if _is_gcsfs_forbidden(e):
            return 403
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                return int(status)
        code = getattr(e, "code", None)  # gcsfs HttpError
        # (not aiohttp's HttpProcessingError family: a body cut short is
        # ContentLengthError/ClientPayloadError with code=400, not an HTTP 400)
        if _is_aiohttp(e):
            code = None
        if isinstance(code, int) and 100 <= code < 600:
            return code
        status = getattr(e, "status", None)  # aiohttp ClientResponseError
        if isinstance(status, int) and 100 <= status < 600:
            return status
    return None


def _is_gcsfs_forbidden(exc: BaseException) -> bool:
    # gcsfs answers a 403 with a bare OSError("Forbidden: <url>\n<message>").
    return type(exc) is OSError and exc.errno is None and str(exc).startswith("Forbidden: ")


def _is_aiohttp(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] == "aiohttp" and not hasattr(exc, "status")


def _error_code(exc: BaseException) -> str | None:
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
    return None


def is_transient(exc: BaseException) -> bool:
    """True for failures worth retrying: throttling, 5xx, resets, timeouts."""
    if isinstance(exc, (CloudCkptError, FileNotFoundError, FileExistsError, PermissionError,
                        EOFError)):
        return False
    if _token_refresh_failed(exc):
        return True
    status = status_of(exc)
    if status is not None:
        return status in _TRANSIENT_STATUS
    if _error_code(exc) in _TRANSIENT_CODES:
        return True
    for e in _chain(exc):
        if isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        if type(e).__module__.split(".")[0] in ("aiohttp", "botocore", "urllib3", "requests"):
            name = type(e).__name__
            if any(w in name for w in ("Connection", "Timeout", "Payload", "Disconnected",
                                       "IncompleteRead", "ReadTimeout", "ProxyError")):
                return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO:
            return True
    return False


def _token_refresh_failed(exc: BaseException) -> bool:
    # gcsfs turns a failed token refresh (metadata server or OAuth endpoint busy)
    # into an HTTP 401, chained from google.auth's RefreshError or TransportError:
    # that is the token service's hiccup, not bad credentials.
    return any(type(e).__module__.startswith("google.auth")
               and type(e).__name__ in ("RefreshError", "TransportError")
               for e in _chain(exc))


def mask_secrets(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret replaced by ``***``, as is and URL-encoded; the
    longest first, so none is left half-masked by a shorter one inside it."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        for form in (secret, quote_plus(secret), quote(secret, safe="")):
            text = text.replace(form, "***")
    return text


def describe(exc: BaseException | None) -> str:
    """A one-line description of an error, with its HTTP status and code when known."""
    if exc is None:
        return "unknown error"
    parts = [type(exc).__name__]
    status, code = status_of(exc), _error_code(exc)
    if status:
        parts.append(f"HTTP {status}")
    if code:
        parts.append(code)
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{' '.join(parts)}: {msg[:300]}" if msg else " ".join(parts)
