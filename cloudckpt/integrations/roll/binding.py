"""ROLL's registries: ``s3``/``gcs`` in its ``uploader_registry`` (and a bucket URI given
to its ``file_system`` type: :mod:`.bucketkey`), and bucket URIs in its
``model_download_registry`` (resuming downloads a committed checkpoint)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, MutableMapping
from types import ModuleType
from typing import Any

from cloudckpt.integrations.roll.bucketkey import file_system_or_bucket
from cloudckpt.integrations.roll.doctor import refuse_unplaceable
from cloudckpt.integrations.roll.resume import default_download_dir, download_checkpoint
from cloudckpt.integrations.roll.uploader import GcsUploader, S3Uploader


def register(uploader_registry: MutableMapping[str, Any],
             model_download_registry: MutableMapping[str, Any] | None = None,
             storage_options: Mapping[str, Any] | None = None) -> None:
    """Add ``s3`` and ``gcs`` to ROLL's ``uploader_registry``, and send a bucket
    ``output_dir`` of its ``file_system`` type to them (call it in every worker process:
    each builds its own CheckpointManager). With
    ``model_download_registry``, also let ``resume_from_checkpoint`` be a bucket
    URI (downloaded with ``storage_options``, default: the environment's)."""
    uploader_registry["s3"] = S3Uploader
    uploader_registry["gcs"] = GcsUploader
    if "file_system" in uploader_registry:
        uploader_registry["file_system"] = file_system_or_bucket(
            uploader_registry["file_system"])
    if model_download_registry is not None:
        wrap_model_downloaders(model_download_registry, storage_options)


def wrap_model_downloaders(registry: MutableMapping[str, Callable[..., str]],
                           storage_options: Mapping[str, Any] | None = None) -> None:
    """Make every downloader in ROLL's ``model_download_registry`` send ``s3://``
    and ``gs://`` paths to :func:`download_checkpoint`.

    Optional: ``resume_from_checkpoint: true`` needs none of this (``get_latest_ckpt``
    already returns a local directory). It only lets an explicit bucket URI be the
    resume value, and only reaches the downloader that ``MODEL_DOWNLOAD_TYPE``
    names (ROLL's default, ``MODELSCOPE``, is absent unless modelscope is
    installed). Calling it again replaces the options; nothing is wrapped twice."""
    for key, fn in list(registry.items()):
        fn = getattr(fn, "_cloudckpt_original", fn)

        def wrapped(model_name_or_path: str, local_dir: str | None = None, *args: Any,
                    _fn: Callable[..., str] = fn, **kwargs: Any) -> str:
            if isinstance(model_name_or_path, str) and model_name_or_path.split("://")[0] in (
                    "s3", "s3a", "gs", "gcs") and "://" in model_name_or_path:
                dest = local_dir or str(default_download_dir(model_name_or_path))
                return download_checkpoint(model_name_or_path, dest, storage_options)
            return _fn(model_name_or_path, local_dir, *args, **kwargs)

        wrapped._cloudckpt_original = fn  # type: ignore[attr-defined]
        registry[key] = wrapped


def bind_checkpoint_manager(module: ModuleType) -> tuple[str, ...]:
    """What activation binds into ``roll.utils.checkpoint_manager`` in every process
    that imports it (the driver and each Ray worker): :func:`register` on its
    registries, so a bucket ``checkpoint_config.output_dir`` (type ``file_system``, ``s3``
    or ``gcs``) and a bucket ``resume_from_checkpoint`` work with no user code. In ROLL's
    driver (its start script imports this module before composing its config) a launch
    that would write a local ``s3:`` directory is refused first, naming the key to set."""
    refuse_unplaceable(sys.argv)
    register(module.uploader_registry, module.model_download_registry)
    return ("uploader_registry['s3']", "uploader_registry['gcs']",
            "uploader_registry['file_system'] (bucket URIs)",
            "model_download_registry (bucket URIs)")
