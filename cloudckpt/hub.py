"""Push a committed export from a bucket to the Hugging Face Hub.

The export is downloaded and every file checked against its manifest first;
a torn or corrupt export is refused before a single request reaches the Hub.
Only the files the manifest lists are pushed, in one commit; large files go
through LFS as ``huggingface_hub`` decides. The token comes from the argument
or the usual places (``HF_TOKEN``, a saved login) and is never logged.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .checkpoint import open_checkpoint
from .errors import AccessDeniedError, ConfigError, StorageError
from .manifest import MANIFEST_NAME
from .storage.retry import describe
from .transfer import download

log = logging.getLogger("cloudckpt.hub")

__all__ = ["PushJob", "push_in_background", "push_to_hub"]


def push_to_hub(
    uri: str,
    repo_id: str,
    *,
    revision: str = "main",
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    endpoint: str | None = None,
) -> str:
    """Verify the export at ``uri``, then push it to ``repo_id``; return the commit
    (or pull request) URL. The repo is created when missing."""
    from huggingface_hub import CommitOperationAdd, HfApi

    ckpt = open_checkpoint(uri, storage_options)
    with tempfile.TemporaryDirectory(prefix="cloudckpt-push-") as tmp:
        local = download(ckpt, tmp)  # checks every byte: corrupt exports stop here
        api = HfApi(endpoint=endpoint, token=token)
        ops = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(Path(local) / path))
               for path in ckpt.files if path != MANIFEST_NAME]
        message = commit_message or (
            f"Upload {Path(ckpt.uri).name} (step {ckpt.step})" if ckpt.step is not None
            else f"Upload {Path(ckpt.uri).name}")
        with _hub_errors(f"pushing {ckpt.uri} to {repo_id}", api.endpoint):
            api.create_repo(repo_id, private=private, exist_ok=True)
            info = api.create_commit(repo_id, ops, commit_message=message, revision=revision,
                                     create_pr=create_pr)
    url = info.pr_url if create_pr and getattr(info, "pr_url", None) else info.commit_url
    log.info("pushed %s (%d files) to %s: %s", ckpt.uri, len(ops), repo_id, url)
    return str(url)


@contextmanager
def _hub_errors(what: str, endpoint: str) -> Iterator[None]:
    """The Hub's HTTP errors as cloudckpt errors saying what to check (the token is
    never quoted: huggingface_hub's messages do not carry it)."""
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    try:
        yield
    except HFValidationError as exc:
        raise ConfigError(f"{what}: {exc}") from None
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        if status in (401, 403):
            raise AccessDeniedError(
                f"{what}: the Hub at {endpoint} refused the request (HTTP {status}: {first}). "
                "Use a token with write access to the repository: --token, HF_TOKEN, or "
                "`hf auth login`") from None
        raise StorageError(f"{what} failed: the Hub at {endpoint} answered HTTP {status}: "
                           f"{first}") from None
    except Exception as exc:
        # Connection refused, DNS, timeouts: OSErrors, or the HTTP client's own errors.
        transport = isinstance(exc, OSError) or type(exc).__name__ in (
            "ConnectError", "ConnectTimeout", "ReadTimeout", "NetworkError", "TransportError",
            "RemoteProtocolError", "ConnectionError", "Timeout")
        if not transport:
            raise
        raise StorageError(f"{what} failed: cannot reach the Hub at {endpoint} "
                           f"({describe(exc)}); check --endpoint (HF_ENDPOINT) and the "
                           "network") from None


class PushJob:
    """A push running in the background: ``status``, ``done()``, ``result()``.

    ``status`` is ``"running"``, ``"done"`` or ``"failed"``; ``result()`` returns
    the commit URL or raises the push's error; ``error`` holds it once failed.
    """

    def __init__(self, future: Future[str], description: str) -> None:
        self._future = future
        self.description = description

    @property
    def status(self) -> str:
        if not self._future.done():
            return "running"
        return "failed" if self._future.exception() is not None else "done"

    @property
    def error(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        return self._future.result(timeout)

    def __repr__(self) -> str:
        return f"PushJob({self.description}, status={self.status})"


def push_in_background(uri: str, repo_id: str, **kwargs: Any) -> PushJob:
    """Start :func:`push_to_hub` on a background thread (e.g. right after an
    export, so training goes on); failures are logged and kept on the job."""
    future: Future[str] = Future()
    description = f"{uri} -> {repo_id}"

    def run() -> None:
        try:
            future.set_result(push_to_hub(uri, repo_id, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - surfaced through the job
            log.error("background push %s failed: %s", description, exc)
            future.set_exception(exc)

    threading.Thread(target=run, name="cloudckpt-push", daemon=True).start()
    return PushJob(future, description)
