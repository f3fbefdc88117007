"""ROLL's registries: ``s3``/``gcs`` in its ``uploader_registry``, and bucket URIs in its
``model_download_registry`` (resuming downloads a committed checkpoint)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from ...checkpoint import read_manifest
from ...errors import CheckpointNotFoundError, IncompleteCheckpointError
from ...storage import open_store
from .uploader import CKPT_RE, GcsUploader, S3Uploader, _committed


def register(uploader_registry: MutableMapping[str, Any],
             model_download_registry: MutableMapping[str, Any] | None = None,
             storage_options: Mapping[str, Any] | None = None) -> None:
    """Add ``s3`` and ``gcs`` to ROLL's ``uploader_registry`` (call it in every
    worker process: each builds its own CheckpointManager). With
    ``model_download_registry``, also let ``resume_from_checkpoint`` be a bucket
    URI (downloaded with ``storage_options``, default: the environment's)."""
    uploader_registry["s3"] = S3Uploader
    uploader_registry["gcs"] = GcsUploader
    if model_download_registry is not None:
        wrap_model_downloaders(model_download_registry, storage_options)


def download_checkpoint(uri_or_latest: str, local_dir: str | os.PathLike[str],
                        storage_options: Mapping[str, Any] | None = None) -> str:
    """Download a committed checkpoint, every object checked, and return its local path.

    ``uri_or_latest`` is a ``.../checkpoint-N`` URI, or an ``output_dir`` whose
    newest committed ``checkpoint-N`` is taken. The files land in
    ``local_dir/checkpoint-N`` in ROLL's layout.
    """
    from ...transfer import download

    store = open_store(str(uri_or_latest).rstrip("/"), storage_options)
    name = store.uri.rstrip("/").rsplit("/", 1)[-1]
    if not CKPT_RE.match(name):
        best = _committed(store)
        if not best:
            raise CheckpointNotFoundError(f"no committed checkpoint-N under {store.uri}")
        name = best[-1][1]
        store = store.child(name)
    try:
        read_manifest(store)
    except IncompleteCheckpointError as exc:
        raise IncompleteCheckpointError(
            f"{store.uri} is a torn ROLL checkpoint (never committed); resume from "
            f"`latest` instead. {exc}") from None
    target = Path(local_dir) / name
    download(store.uri, target, storage_options)
    return str(target)


def _cache_dir_for(uri: str) -> Path:
    from ...hf import cache_dir

    return cache_dir() / "roll" / hashlib.sha1(uri.encode()).hexdigest()[:16]


def wrap_model_downloaders(registry: MutableMapping[str, Callable[..., str]],
                           storage_options: Mapping[str, Any] | None = None) -> None:
    """Make every downloader in ROLL's ``model_download_registry`` send ``s3://``
    and ``gs://`` paths to :func:`download_checkpoint` (ROLL resumes through
    ``download_model``, which otherwise sends them to a model hub and fails).
    Calling it again replaces the options; nothing is wrapped twice."""
    for key, fn in list(registry.items()):
        fn = getattr(fn, "_cloudckpt_original", fn)

        def wrapped(model_name_or_path: str, local_dir: str | None = None, *args: Any,
                    _fn: Callable[..., str] = fn, **kwargs: Any) -> str:
            if isinstance(model_name_or_path, str) and model_name_or_path.split("://")[0] in (
                    "s3", "s3a", "gs", "gcs") and "://" in model_name_or_path:
                dest = local_dir or str(_cache_dir_for(model_name_or_path))
                return download_checkpoint(model_name_or_path, dest, storage_options)
            return _fn(model_name_or_path, local_dir, *args, **kwargs)

        wrapped._cloudckpt_original = fn  # type: ignore[attr-defined]
        registry[key] = wrapped
