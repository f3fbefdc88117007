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
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .checkpoint import open_checkpoint
from .hf import download
from .manifest import MANIFEST_NAME

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
        api.create_repo(repo_id, private=private, exist_ok=True)
        ops = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(Path(local) / path))
               for path in ckpt.files if path != MANIFEST_NAME]
        message = commit_message or (
            f"Upload {Path(ckpt.uri).name} (step {ckpt.step})" if ckpt.step is not None
            else f"Upload {Path(ckpt.uri).name}")
        info = api.create_commit(repo_id, ops, commit_message=message, revision=revision,
                                 create_pr=create_pr)
    url = info.pr_url if create_pr and getattr(info, "pr_url", None) else info.commit_url
    log.info("pushed %s (%d files) to %s: %s", ckpt.uri, len(ops), repo_id, url)
    return str(url)


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
