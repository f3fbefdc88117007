"""How a push's files reach a Hub repo: which changed, the LFS uploads (all before any
commit, sending only what the Hub lacks), the commits (one, or batches with the index
last), the upload progress bars, and the Hub's errors as cloudckpt errors.
:mod:`cloudckpt.hf.hub` decides what to push; this module moves it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

from cloudckpt.compat.hub_private import lfs_batch
from cloudckpt.errors import (
    AccessDeniedError,
    CloudCkptError,
    CommitConflictError,
    ConfigError,
    StorageError,
)
from cloudckpt.storage.retry import describe

log = logging.getLogger(__name__)

#: Names at a repo's root that ``from_pretrained`` may load weights from; a push
#: never leaves ones the export does not have beside the new weights.
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.index.json")
#: Objects per LFS batch request, as ``huggingface_hub`` sends them.
_BATCH = 256


def is_weight_file(path: str) -> bool:
    """Whether ``path`` in a repo is a weight file or shard index ``from_pretrained``
    reads: at the root only (a subfolder is another model's, or nobody's)."""
    return "/" not in path and any(fnmatch.fnmatchcase(path, p) for p in WEIGHT_PATTERNS)


def is_index(path: str) -> bool:
    return is_weight_file(path) and path.endswith(".index.json")


def hash_all(ops: Iterable[Any], workers: int = 8) -> None:
    """Hash every file to push, a few at once: for big exports hashing is a pass over
    every byte, which the comparison with the repo and the LFS batch both need."""
    with ThreadPoolExecutor(workers, thread_name_prefix="cloudckpt-hash") as pool:
        list(pool.map(lambda op: op.upload_info.sha256, ops))


def unchanged(sibling: Any, op: Any, local: Path) -> bool:
    """Whether the repo's file is already exactly ``local``: its LFS sha256, or its git
    blob id for a regular file."""
    if sibling is None or sibling.size not in (None, local.stat().st_size):
        return False
    lfs = getattr(sibling, "lfs", None)
    if lfs:
        sha = lfs.get("sha256") if isinstance(lfs, Mapping) else getattr(lfs, "sha256", None)
        return sha == op.upload_info.sha256.hex()
    data = local.read_bytes()
    return sibling.blob_id == hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def plan_commits(changed: list[str], stale: list[str], files: list[str], held: set[str],
                 shards: set[str], per_commit: int | None) -> list[list[tuple[bool, str]]]:
    """The commits to make, each a list of ``(add?, path)``: one, or batches of at most
    ``per_commit`` with the shard indexes, ``config.json``, unsharded weights and the
    deletions last, so the repo serves the old model until the last commit. Where that
    cannot be (the early batches would overwrite weights it serves, or the deletions do
    not fit in the last), the first batch takes the old model down instead (its indexes,
    then the stale weights): the repo serves none until the last, never a mix."""
    ops = [(True, p) for p in changed] + [(False, p) for p in stale]
    if per_commit is None or len(ops) <= per_commit:
        return [ops] if ops else []
    at_end = [p for p in changed if p == "config.json" or (is_weight_file(p) and p not in shards)]
    early: list[tuple[bool, str]] = [(True, p) for p in changed if p not in at_end]
    deletes = list(stale)
    if (any(p in held and is_weight_file(p) for _, p in early)
            or len(at_end) + len(deletes) > per_commit):
        down = sorted(p for p in held if is_index(p))
        early = [(False, p) for p in [*down, *(p for p in deletes if p not in down)]] + early
        at_end += [p for p in down if p in files and p not in at_end]  # the new index
        deletes = []
    last = [(True, p) for p in at_end] + [(False, p) for p in deletes]
    if len(last) > per_commit:
        raise ConfigError(
            f"files_per_commit={per_commit} is too few: the last commit must hold "
            f"{', '.join(p for _, p in last)} together ({len(last)} operations), so the repo "
            f"never serves a part of the model; pass at least {len(last)}. Nothing was pushed")
    plan = [early[i:i + per_commit] for i in range(0, len(early), per_commit)]
    if not last:
        return plan
    if plan and len(plan[-1]) + len(last) <= per_commit and not (
            {p for _, p in plan[-1]} & set(at_end)):  # not a delete and an add of one path
        plan[-1] += last
    else:
        plan.append(last)
    return plan


def upload_missing(api: Any, repo_id: str, ops: list[Any], revision: str, create_pr: bool,
                   token: str | None) -> None:
    """Upload every LFS object the Hub lacks, before any commit: the batch API's answer
    lists objects it already has without upload actions (``huggingface_hub`` then skips
    them), so a push run again after an interruption sends only the rest."""
    if not ops:
        return
    there: set[str] = set()
    for i in range(0, len(ops), _BATCH):
        chunk = ops[i:i + _BATCH]
        actions, errors = lfs_batch(  # as huggingface_hub asks: the branch, unless a PR
            [op.upload_info for op in chunk], token, repo_id, api.endpoint,
            None if create_pr else quote(revision, safe=""))
        by_oid = {obj.get("oid"): obj for obj in [*actions, *errors]}
        for op in chunk:
            obj = by_oid.get(op.upload_info.sha256.hex(), {})
            if "error" in obj:
                raise object_refusal(repo_id, op.path_in_repo, obj["error"])
            if obj and not obj.get("actions"):
                there.add(op.path_in_repo)
    sent = sum(op.upload_info.size for op in ops if op.path_in_repo not in there)
    log.info("%s: %d of %d files already on the Hub, sending the other %d (%d bytes)",
             repo_id, len(there), len(ops), len(ops) - len(there), sent)
    api.preupload_lfs_files(repo_id, additions=ops, revision=revision, create_pr=create_pr)


def object_refusal(repo_id: str, path: str, error: Any) -> CloudCkptError:
    """A per-object error of the LFS batch answer (a file over the Hub's size limit)."""
    message = str(error.get("message") if isinstance(error, Mapping) else error)[:300]
    if "too large" in message.lower():
        return ConfigError(f"the Hub refuses {path} for {repo_id}: {message}. Export the model "
                           "again with a smaller max_shard_size (cloudckpt.hf.export) and push "
                           "that; nothing was committed")
    return StorageError(f"the Hub refuses {path} for {repo_id}: {message}")


def make_commits(api: Any, repo_id: str, plan: list[list[tuple[bool, str]]],
                 adds: dict[str, Any], local: Path, revision: str, create_pr: bool,
                 parent: str | None, message: str) -> tuple[list[str], str]:
    """Make the planned commits in order, each on the one before; return their URLs and
    the last one's (or the pull request's: with ``create_pr`` the first opens it, the
    others go to it)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    urls: list[str] = []
    pr_url: str | None = None
    deleted: set[str] = set()
    for i, batch in enumerate(plan):
        # A file deleted by an earlier batch gets a new operation: the first one was told
        # the repo held it unchanged, and huggingface_hub would leave it out.
        ops = [CommitOperationDelete(path_in_repo=p) if not add else
               CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(local / p))
               if p in deleted else adds[p] for add, p in batch]
        deleted.update(p for add, p in batch if not add)
        title = message if len(plan) == 1 else f"{message} ({i + 1}/{len(plan)})"
        info = api.create_commit(repo_id, ops, commit_message=title, revision=revision,
                                 create_pr=create_pr and pr_url is None, parent_commit=parent)
        parent = info.oid
        urls.append(str(info.commit_url))
        if create_pr and pr_url is None:
            pr_url = str(getattr(info, "pr_url", None) or urls[-1])
            revision = getattr(info, "pr_revision", None) or revision
        if len(plan) > 1:
            log.info("%s: commit %d of %d: %s", repo_id, i + 1, len(plan), urls[-1])
    return urls, pr_url or urls[-1]


@contextmanager
def progress_bars(show: bool | None) -> Iterator[None]:
    """``huggingface_hub``'s progress bars shown or hidden for the block, then as before
    (``None``, or ``HF_HUB_DISABLE_PROGRESS_BARS`` set: left as configured)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    shown = not are_progress_bars_disabled()
    if show is None or show == shown or constants.HF_HUB_DISABLE_PROGRESS_BARS is not None:
        yield
        return
    (enable_progress_bars if show else disable_progress_bars)()
    try:
        yield
    finally:
        (enable_progress_bars if shown else disable_progress_bars)()


@contextmanager
def hub_errors(what: str, endpoint: str, revision: str) -> Iterator[None]:
    """The Hub's errors as cloudckpt errors saying what to check (the token is never
    quoted: huggingface_hub's messages do not carry it)."""
    try:
        yield
    except Exception as exc:
        # An LFS upload's failure comes wrapped in a RuntimeError naming the file.
        cause = exc.__cause__ if isinstance(exc, RuntimeError) else None
        err = _translate(exc, what, endpoint, revision) or (
            _translate(cause, what, endpoint, revision) if isinstance(cause, Exception) else None)
        if err is None:
            raise
        raise err from None


def _translate(exc: Exception, what: str, endpoint: str, revision: str) -> CloudCkptError | None:
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RevisionNotFoundError

    if isinstance(exc, HFValidationError):
        return ConfigError(f"{what}: {exc}")
    if isinstance(exc, RevisionNotFoundError):
        return ConfigError(f"{what}: the repo has no branch {revision!r}; create it first "
                           "(huggingface_hub's HfApi.create_branch) or push to main")
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        said = str(getattr(exc, "server_message", None) or exc)
        if status in (401, 403):
            return AccessDeniedError(
                f"{what}: the Hub at {endpoint} refused the request (HTTP {status}: {first}). "
                "Use a token with write access to the repository: --token, HF_TOKEN, or "
                "`hf auth login`")
        if status == 412:  # parent_commit: someone committed after the repo was inspected
            return CommitConflictError(
                f"{what}: revision {revision} changed on the Hub while pushing (HTTP 412); "
                "that commit was not made: push again")
        if status in (400, 413, 422) and re.search(r"too many (operations|files)", said, re.I):
            return ConfigError(
                f"{what}: the Hub refused a commit with that many operations (HTTP {status}: "
                f"{said.strip()[:200]}); pass files_per_commit=N (--files-per-commit N) to "
                "commit in batches of at most N, the index last")
        return StorageError(f"{what} failed: the Hub at {endpoint} answered HTTP {status}: "
                            f"{first}")
    # Connection refused, DNS, timeouts: OSErrors, or the HTTP client's own errors.
    if isinstance(exc, OSError) or type(exc).__name__ in (
            "ConnectError", "ConnectTimeout", "ReadTimeout", "NetworkError", "TransportError",
            "RemoteProtocolError", "ConnectionError", "Timeout"):
        return StorageError(f"{what} failed: cannot reach the Hub at {endpoint} "
                            f"({describe(exc)}); check --endpoint (HF_ENDPOINT) and the network")
    return None
