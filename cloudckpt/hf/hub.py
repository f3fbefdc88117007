"""Push one committed HF export from a bucket to the Hugging Face Hub.

Only an HF export (manifest kind ``"hf"``, with ``config.json`` and weights) is
pushed: a DCP or training checkpoint is refused before any request reaches the
Hub, naming what to convert it with. The export is downloaded and every file
checked against its manifest first; a torn or corrupt export is refused there.

The push leaves the repo holding exactly one model: weight files at the repo's
root that the export does not have (``*.safetensors``, ``pytorch_model*.bin``,
``*.index.json``: what ``from_pretrained`` reads) would sit beside the new ones,
so the push refuses to commit over them unless told ``replace=True``, which
deletes exactly those in the same commit. Nothing else in the repo is touched.
The commit is made on the revision that was inspected (``parent_commit``), so a
concurrent change makes it fail instead of leaving a mix.

Large files go through LFS as ``huggingface_hub`` decides. The token comes from
the argument or the usual places (``HF_TOKEN``, a saved login) and is never logged.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import logging
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloudckpt.core import kinds
from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.manifest import MANIFEST_NAME
from cloudckpt.errors import (
    AccessDeniedError,
    CloudCkptError,
    CommitConflictError,
    ConfigError,
    StorageError,
)
from cloudckpt.movement.transfer import download
from cloudckpt.runtime.pending import run_in_background
from cloudckpt.storage.retry import describe

log = logging.getLogger("cloudckpt.hf.hub")

__all__ = ["WEIGHT_PATTERNS", "PushJob", "PushResult", "push", "push_in_background",
           "push_to_hub"]

#: Names at a repo's root that ``from_pretrained`` may load weights from; a push
#: never leaves ones the export does not have beside the new weights.
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.index.json")


@dataclass(frozen=True)
class PushResult:
    """What a push did: the commit (or pull request) URL, the files it added or
    overwrote, and the repo's weight files it deleted (``replace=True``)."""

    url: str
    pushed: tuple[str, ...]
    replaced: tuple[str, ...] = ()


def _is_weight_file(path: str) -> bool:
    """Whether ``path`` in a repo is a weight file or shard index ``from_pretrained``
    reads: at the root only (a subfolder is another model's, or nobody's)."""
    return "/" not in path and any(fnmatch.fnmatchcase(path, p) for p in WEIGHT_PATTERNS)


def push_to_hub(uri: str, repo_id: str, **options: Any) -> str:
    """:func:`push`, returning only the commit (or pull request) URL; ``options`` are
    :func:`push`'s (``revision``, ``private``, ``token``, ``replace``, ...)."""
    return push(uri, repo_id, **options).url


def push(
    uri: str,
    repo_id: str,
    *,
    revision: str = "main",
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    replace: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    endpoint: str | None = None,
) -> PushResult:
    """Verify the HF export at ``uri``, then push it to ``repo_id`` in one commit; return
    the commit (or pull request) URL, the files pushed and the files replaced. The repo
    is created when missing. Weight files already in the repo that the export does not
    have are refused (``CommitConflictError``) unless ``replace``, which deletes them
    in the same commit."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    ckpt = open_checkpoint(uri, storage_options)
    files = _export_files(ckpt, storage_options)  # not an HF export: refused before any download
    with tempfile.TemporaryDirectory(prefix="cloudckpt-push-") as tmp:
        local = download(ckpt, tmp)  # checks every byte: corrupt exports stop here
        _check_indexes(local, files, ckpt.uri)
        api = HfApi(endpoint=endpoint, token=token)
        what = f"pushing {ckpt.uri} to {repo_id}"
        with _hub_errors(what, api.endpoint, revision):
            api.create_repo(repo_id, private=private, exist_ok=True)
            head = api.model_info(repo_id, revision=revision)
        stale = _stale_weights((s.rfilename for s in head.siblings or ()), files)
        if stale and not replace:
            raise _stale_refusal(repo_id, revision, stale)
        if stale:
            log.info("replacing %s in %s: weight files the export does not have, deleted "
                     "in the same commit", ", ".join(stale), repo_id)
        ops: list[Any] = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(local / p))
                          for p in files]
        ops += [CommitOperationDelete(path_in_repo=p) for p in stale]
        with _hub_errors(what, api.endpoint, revision):
            info = api.create_commit(repo_id, ops, commit_message=commit_message or _message(
                ckpt), revision=revision, create_pr=create_pr, parent_commit=head.sha)
    url = info.pr_url if create_pr and getattr(info, "pr_url", None) else info.commit_url
    log.info("pushed %s (%d files) to %s: %s", ckpt.uri, len(files), repo_id, url)
    return PushResult(str(url), tuple(files), tuple(stale))


def _export_files(ckpt: Checkpoint, storage_options: Mapping[str, Any] | None = None
                  ) -> list[str]:
    """The files of the HF export ``ckpt`` to push; anything else is refused here, so a
    training or DCP checkpoint never reaches a model repo."""
    kind = ckpt.manifest.kind
    if kind != kinds.HF:
        raise ConfigError(f"{ckpt.uri} is {_describe_kind(kind)}, not a Hugging Face export "
                          f"(manifest kind {kinds.HF!r}); push publishes HF exports only. "
                          f"{_what_to_pass(ckpt.uri, kind, storage_options)}")
    files = [p for p in ckpt.files if p != MANIFEST_NAME]
    missing = [name for name, ok in (
        ("config.json", "config.json" in files),
        ("weights (*.safetensors or pytorch_model*.bin)",
         any(_is_weight_file(p) and not p.endswith(".index.json") for p in files)))
        if not ok]
    if missing:
        raise ConfigError(f"{ckpt.uri} is an HF export without {' or '.join(missing)}: "
                          "from_pretrained could not load it from the Hub. Export the model "
                          "again (cloudckpt.hf.export) and push that")
    return files


def _stale_weights(repo_files: Iterable[str], export: Iterable[str]) -> list[str]:
    """The repo's root weight files the export does not have: left beside the new ones,
    ``from_pretrained`` would read the wrong model or fail."""
    ours = set(export)
    return sorted(p for p in repo_files if _is_weight_file(p) and p not in ours)


def _describe_kind(kind: str) -> str:
    return {kinds.TRAINING: "a training checkpoint (model and optimizer DCP shards, RNG and "
                        "training state)",
            kinds.DCP: "a DCP checkpoint"}.get(kind, f"a checkpoint of kind {kind!r}")


def _what_to_pass(uri: str, kind: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """How to get an HF export from a checkpoint of ``kind``."""
    from cloudckpt.core.plugins import export_of

    convert = f"`cloudckpt convert dcp-to-hf {uri} DST --config config.json`"
    inside = export_of(kind)
    if inside is not None:  # a framework's save that may hold one
        sub, setting = inside
        target = f"{uri.rstrip('/')}/{sub}"
        try:
            held = open_checkpoint(target, storage_options).manifest.kind == kinds.HF
        except CloudCkptError:
            held = False
        if held:
            return f"Its HF export is {target}: push that"
        return (f"It holds no HF export at {sub}/" + (f": set {setting} and save again"
                                                       if setting else ""))
    if kind in (kinds.TRAINING, kinds.DCP):
        return f"Convert its model to one first ({convert}), then push DST"
    return ("Pass an HF export: write one with cloudckpt.hf.export (a local model folder: "
            "cloudckpt.training.staging.upload_dir(folder, uri, kind='hf')), or convert a "
            f"checkpoint holding DCP shards with {convert}")


def _check_indexes(local: Path, files: list[str], uri: str) -> None:
    """Every shard an index names is in the export: a repo is never left pointing at
    shards this push does not bring (or is about to delete)."""
    have = set(files)
    for index in (p for p in files if _is_weight_file(p) and p.endswith(".index.json")):
        try:
            shards = set(json.loads((local / index).read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{uri}: {index} is not a shard index ({exc!r}); export the "
                              "model again") from None
        if shards - have:
            raise ConfigError(f"{uri}: {index} names shards the export does not have: "
                              f"{', '.join(sorted(shards - have))}; export the model again")


def _stale_refusal(repo_id: str, revision: str, stale: list[str]) -> CommitConflictError:
    return CommitConflictError(
        f"{repo_id} (revision {revision}) already holds weight files this export does not "
        f"have: {', '.join(stale)}. Beside the new weights, from_pretrained would load the "
        "wrong model or fail. Pass replace=True (--replace) to delete exactly those in the "
        "same commit, or push to another repo; nothing was pushed")


def _message(ckpt: Checkpoint) -> str:
    name = Path(ckpt.uri).name
    return f"Upload {name} (step {ckpt.step})" if ckpt.step is not None else f"Upload {name}"


@contextmanager
def _hub_errors(what: str, endpoint: str, revision: str) -> Iterator[None]:
    """The Hub's HTTP errors as cloudckpt errors saying what to check (the token is
    never quoted: huggingface_hub's messages do not carry it)."""
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RevisionNotFoundError

    try:
        yield
    except HFValidationError as exc:
        raise ConfigError(f"{what}: {exc}") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{what}: the repo has no branch {revision!r}; create it first "
                          "(huggingface_hub's HfApi.create_branch) or push to main") from None
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        if status in (401, 403):
            raise AccessDeniedError(
                f"{what}: the Hub at {endpoint} refused the request (HTTP {status}: {first}). "
                "Use a token with write access to the repository: --token, HF_TOKEN, or "
                "`hf auth login`") from None
        if status == 412:  # parent_commit: someone committed after the repo was inspected
            raise CommitConflictError(
                f"{what}: revision {revision} changed on the Hub while pushing (HTTP 412); "
                "nothing was pushed: push again") from None
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
    export, so training goes on); failures are logged and kept on the job, and a
    push still running when the process ends is waited for, or reported
    (:mod:`cloudckpt.runtime.pending`). ``kwargs`` (``replace=True`` included) are checked
    here, not in the thread."""
    inspect.signature(push).bind(uri, repo_id, **kwargs)  # a typo fails now
    description = f"{uri} -> {repo_id}"

    def run() -> str:
        try:
            return push_to_hub(uri, repo_id, **kwargs)
        except BaseException as exc:
            log.error("background push %s failed: %s", description, exc)
            raise

    # Tracked like a background save: a push still running at exit is waited for.
    return PushJob(run_in_background(run, f"Hub push {description}", name="cloudckpt-push"),
                   description)
