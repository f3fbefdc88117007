"""Push one committed HF export from a bucket to the Hugging Face Hub.

Only an HF export (manifest kind ``"hf"``, with ``config.json`` and weights) is
pushed: a DCP or training checkpoint is refused before any request reaches the
Hub, naming what to convert it with. So is an export holding a file above the
Hub's per-file limit (:data:`HUB_FILE_LIMIT`), seen in the manifest's sizes.
The export is downloaded and every file checked against its manifest first; a torn
or corrupt export is refused there.

The push leaves the repo holding exactly one model: weight files at the repo's
root that the export does not have (``*.safetensors``, ``pytorch_model*.bin``,
``*.index.json``: what ``from_pretrained`` reads) would sit beside the new ones,
so the push refuses to commit over them unless told ``replace=True``, which
deletes exactly those in the (last) commit. Nothing else in the repo is touched.

Every LFS object is uploaded before anything is committed; the LFS batch API says
which the Hub already has (an interrupted push, run again, sends only the rest).
Then one commit adds the files that changed, made on the revision inspected
(``parent_commit``), so a concurrent change makes it fail instead of leaving a mix.
Where the Hub limits operations per commit, ``files_per_commit`` makes several,
each on the one before, with the index, ``config.json`` and the deletions last: until
the last lands, the repo serves the old model or none, never an index naming shards
it lacks. The token comes from the argument or the usual places (``HF_TOKEN``, a
saved login) and is never logged.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloudckpt.core import kinds
from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.manifest import MANIFEST_NAME
from cloudckpt.errors import CloudCkptError, CommitConflictError, ConfigError
from cloudckpt.hf.hubcommit import (
    WEIGHT_PATTERNS,
    hash_all,
    hub_errors,
    is_index,
    is_weight_file,
    make_commits,
    plan_commits,
    progress_bars,
    unchanged,
    upload_missing,
)
from cloudckpt.hf.lazy import read_header
from cloudckpt.movement.checkpoint_copy import download
from cloudckpt.runtime.pending import run_in_background

log = logging.getLogger(__name__)

__all__ = ["HUB_FILE_LIMIT", "WEIGHT_PATTERNS", "PushJob", "PushOptions", "PushResult", "push",
           "push_in_background", "push_to_hub"]

#: The largest file the Hub stores (50 GB); :func:`cloudckpt.hf.export` shards below it.
HUB_FILE_LIMIT = 50 * 10**9


@dataclass(frozen=True)
class PushResult:
    """What a push did: the last commit's (or the pull request's) URL, the files it added
    or overwrote, the repo's weight files it deleted (``replace=True``), and every commit
    made, oldest first (several with ``files_per_commit``; none when the repo already
    held the export)."""

    url: str
    pushed: tuple[str, ...]
    replaced: tuple[str, ...] = ()
    commits: tuple[str, ...] = ()


@dataclass(frozen=True)
class PushOptions:
    """How :func:`push` publishes an export.

    ``revision``: the branch committed to (it must exist). ``private``: the
    visibility of a repo the push creates (``None``: the Hub's default).
    ``commit_message``: the last commit's (by default ``Upload NAME (step N)``).
    ``create_pr``: open a pull request from ``revision`` instead of committing to it.
    ``replace``: delete the repo's weight files the export does not have, in the last
    commit; without it they are refused (``CommitConflictError``). ``max_file_size``:
    a file above it is refused before any request. ``files_per_commit``: at most that
    many operations per commit, for a Hub that limits them. ``progress``: show or hide
    ``huggingface_hub``'s upload bars (``None``: as configured)."""

    revision: str = "main"
    private: bool | None = None
    commit_message: str | None = None
    create_pr: bool = False
    replace: bool = False
    max_file_size: int = HUB_FILE_LIMIT
    files_per_commit: int | None = None
    progress: bool | None = None


def push_to_hub(uri: str, repo_id: str, *, token: str | None = None,
                endpoint: str | None = None, storage_options: Mapping[str, Any] | None = None,
                **options: Any) -> str:
    """:func:`push`, returning only the commit (or pull request) URL; ``options`` are
    :class:`PushOptions`' fields (``revision``, ``private``, ``replace``, ...), as
    ``transformers``' ``push_to_hub`` takes them."""
    return push(uri, repo_id, PushOptions(**options), token=token, endpoint=endpoint,
                storage_options=storage_options).url


def push(
    uri: str,
    repo_id: str,
    options: PushOptions = PushOptions(),
    *,
    token: str | None = None,
    endpoint: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> PushResult:
    """Verify the HF export at ``uri``, upload its LFS objects the Hub lacks, then commit
    the files that changed to ``repo_id`` (created when missing), as ``options`` say;
    return the commit (or pull request) URL, the files pushed and the files replaced.

    ``token`` and ``endpoint`` are the Hub's (by default ``HF_TOKEN`` or a saved login,
    and ``HF_ENDPOINT``); ``storage_options`` the bucket's."""
    from huggingface_hub import CommitOperationAdd, HfApi

    ckpt = open_checkpoint(uri, storage_options)
    files = _export_files(ckpt, storage_options)  # not an HF export: refused before any download
    _check_sizes(ckpt, files, options.max_file_size)
    revision, create_pr, files_per_commit = (options.revision, options.create_pr,
                                             options.files_per_commit)
    if files_per_commit is not None and files_per_commit < 1:
        raise ConfigError(f"files_per_commit must be at least 1, not {files_per_commit}")
    with (tempfile.TemporaryDirectory(prefix="cloudckpt-push-") as tmp,
          progress_bars(options.progress)):
        local = download(ckpt, tmp)  # checks every byte: corrupt exports stop here
        shards = _check_indexes(local, files, ckpt.uri)
        api = HfApi(endpoint=endpoint, token=token)
        what = f"pushing {ckpt.uri} to {repo_id}"
        with hub_errors(what, api.endpoint, revision):
            api.create_repo(repo_id, private=options.private, exist_ok=True)
            head = api.model_info(repo_id, revision=revision, files_metadata=True)
        held = {s.rfilename: s for s in head.siblings or ()}
        stale = _stale_weights(held, files)
        if stale and not options.replace:
            raise _stale_refusal(repo_id, revision, stale)
        adds = {p: CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(local / p))
                for p in files}
        hash_all(adds.values())
        changed = [p for p in files if not unchanged(held.get(p), adds[p], local / p)]
        plan = plan_commits(changed, stale, files, set(held), shards, files_per_commit)
        if not plan:
            url = f"{api.endpoint}/{repo_id}/commit/{head.sha}"
            log.info("%s (revision %s) already holds %s: nothing to commit", repo_id,
                     revision, ckpt.uri)
            return PushResult(url, (), (), ())
        if stale:
            log.info("replacing %s in %s: weight files the export does not have, deleted "
                     "in the %s commit", ", ".join(stale), repo_id,
                     "same" if len(plan) == 1 else "last")
        with hub_errors(what, api.endpoint, revision):
            upload_missing(api, repo_id, [adds[p] for p in changed], revision, create_pr, token)
            urls, url = make_commits(api, repo_id, plan, adds, local, revision, create_pr,
                                     head.sha, options.commit_message or _message(ckpt))
    log.info("pushed %s (%d files, %d commit(s)) to %s: %s", ckpt.uri, len(changed),
             len(urls), repo_id, url)
    return PushResult(url, tuple(changed), tuple(stale), tuple(urls))


def _check_sizes(ckpt: Checkpoint, files: list[str], limit: int) -> None:
    """Refuse a file the Hub would refuse, before anything is downloaded or sent."""
    over = [(p, n) for p, n in ((p, ckpt.entry(p).size) for p in files) if n > limit]
    if not over:
        return
    listed = ", ".join(f"{p} is {_gb(n)}" for p, n in over)
    message = (f"{ckpt.uri}: {listed}, above the Hub's limit of {_gb(limit)} per file; "
               "nothing was pushed. Export the model again with smaller shards: "
               f"cloudckpt.hf.export(..., max_shard_size=...) below {_gb(limit)} (or "
               "`cloudckpt convert dcp-to-hf ... --max-shard-size`), and push that")
    tensors = [t for t in (_largest_tensor(ckpt, p) for p, _ in over) if t is not None]
    big = max(tensors, key=lambda t: t[1], default=None)
    if big is not None and big[1] > limit:
        message += (f". But its tensor {big[0]!r} alone is {_gb(big[1])}: a tensor cannot "
                    "be split across shards, so no shard size brings it below the limit")
    raise ConfigError(message)


def _gb(n: int) -> str:
    return f"{n} bytes ({n / 10**9:.2f} GB)"


def _largest_tensor(ckpt: Checkpoint, path: str) -> tuple[str, int] | None:
    """The biggest tensor of a safetensors file, from its header alone (``None`` when
    it cannot be read)."""
    try:
        spans = read_header(ckpt, path).tensors.values()
    except CloudCkptError:
        return None
    big = max(spans, key=lambda s: s.nbytes, default=None)
    return None if big is None else (big.name, big.nbytes)


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
         any(is_weight_file(p) and not is_index(p) for p in files)))
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
    return sorted(p for p in repo_files if is_weight_file(p) and p not in ours)


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


def _check_indexes(local: Path, files: list[str], uri: str) -> set[str]:
    """Every shard an index names is in the export: a repo is never left pointing at
    shards this push does not bring (or is about to delete). Returns the shards named."""
    have, named = set(files), set()
    for index in (p for p in files if is_index(p)):
        try:
            shards = set(json.loads((local / index).read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{uri}: {index} is not a shard index ({exc!r}); export the "
                              "model again") from None
        if shards - have:
            raise ConfigError(f"{uri}: {index} names shards the export does not have: "
                              f"{', '.join(sorted(shards - have))}; export the model again")
        named |= shards
    return named


def _stale_refusal(repo_id: str, revision: str, stale: list[str]) -> CommitConflictError:
    return CommitConflictError(
        f"{repo_id} (revision {revision}) already holds weight files this export does not "
        f"have: {', '.join(stale)}. Beside the new weights, from_pretrained would load the "
        "wrong model or fail. Pass replace=True (--replace) to delete exactly those in the "
        "same commit, or push to another repo; nothing was pushed")


def _message(ckpt: Checkpoint) -> str:
    name = Path(ckpt.uri).name
    return f"Upload {name} (step {ckpt.step})" if ckpt.step is not None else f"Upload {name}"


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


def push_in_background(uri: str, repo_id: str, options: PushOptions = PushOptions(), *,
                       token: str | None = None, endpoint: str | None = None,
                       storage_options: Mapping[str, Any] | None = None) -> PushJob:
    """Start :func:`push` on a background thread (e.g. right after an export, so
    training goes on); the job's result is the commit URL. Failures are logged and kept
    on the job, and a push still running when the process ends is waited for, or
    reported (:mod:`cloudckpt.runtime.pending`)."""
    description = f"{uri} -> {repo_id}"

    def run() -> str:
        try:
            return push(uri, repo_id, options, token=token, endpoint=endpoint,
                        storage_options=storage_options).url
        except BaseException as exc:
            log.error("background push %s failed: %s", description, exc)
            raise

    # Tracked like a background save: a push still running at exit is waited for.
    return PushJob(run_in_background(run, f"Hub push {description}", name="cloudckpt-push"),
                   description)
