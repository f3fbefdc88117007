"""What the S3 backend makes of its storage options: s3fs's settings with cloudckpt's
defaults, a store's own create-only header, and the credentials it was given,
masked in botocore's debug logs.
"""

from __future__ import annotations

import copy
import logging
import os
import ssl
import threading
from collections.abc import Mapping
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.storage.retry import mask_secrets

# botocore's DEBUG lines carry the session token (the request headers it sends and
# the canonical request it signs); these loggers get a filter that masks every
# credential an S3 backend was given, so `cloudckpt -vv` output is safe to share.
_LEAKY_LOGGERS = ("botocore.auth", "botocore.endpoint", "aiobotocore.endpoint")
_secrets: tuple[str, ...] = ()  # replaced whole under the lock, read without it
_secrets_lock = threading.Lock()


class _MaskSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        secrets = _secrets
        if secrets:
            message = record.getMessage()
            masked = mask_secrets(message, secrets)
            if masked != message:
                record.msg, record.args = masked, None
        return True


_MASK = _MaskSecrets()


def mask_credentials(options: dict[str, Any]) -> None:
    """Register the credentials in ``options`` (and the environment's) for masking."""
    global _secrets
    client = options.get("client_kwargs")
    client = client if isinstance(client, dict) else {}
    found = [options.get("secret"), options.get("token"),
             client.get("aws_secret_access_key"), client.get("aws_session_token"),
             os.environ.get("AWS_SECRET_ACCESS_KEY"), os.environ.get("AWS_SESSION_TOKEN")]
    new = {v for v in found if isinstance(v, str) and len(v) >= 8} - set(_secrets)
    if new:
        with _secrets_lock:
            if not _secrets:
                for name in _LEAKY_LOGGERS:
                    logging.getLogger(name).addFilter(_MASK)
            _secrets = (*_secrets, *new)


def create_only_header(value: Any) -> tuple[str, str] | None:
    """``create_only_header``: ``"Name: value"`` or a mapping of one header."""
    if value is None:
        return None
    if isinstance(value, str) and ":" in value:
        name, _, val = value.partition(":")
        pair = (name.strip(), val.strip())
    elif isinstance(value, Mapping) and len(value) == 1:
        ((name, val),) = value.items()
        pair = (str(name).strip(), str(val).strip())
    else:
        pair = ("", "")
    if not pair[0] or not pair[1]:
        raise ConfigError(f"storage option create_only_header must look like "
                          f"'x-oss-forbid-overwrite: true' (or a one-entry mapping), "
                          f"got {value!r}")
    return pair


def s3fs_options(options: dict[str, Any], max_concurrency: int) -> dict[str, Any]:
    """s3fs options with our defaults filled in where the user set none."""
    opts = copy.deepcopy(options)
    config = dict(opts.pop("config_kwargs", None) or {})
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    config.setdefault("connect_timeout", 10)
    config.setdefault("read_timeout", 60)
    config.setdefault("max_pool_connections", max(2 * max_concurrency, 10))
    if sends_checksums(config):
        # Every upload then carries a checksum the server verifies (our CRC32C, or
        # botocore's own CRC32), so its body is not also SHA-256'd into the signature:
        # what botocore already does on HTTPS, here on plain-HTTP endpoints too (a
        # pass over every byte, about a third of a save's client CPU on loopback).
        config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
    opts["config_kwargs"] = config
    return opts


def sends_checksums(config: Mapping[str, Any]) -> bool:
    """Whether uploads carry a flexible checksum: botocore's switch, which turns ours
    off too (for servers without flexible checksums)."""
    return config.get("request_checksum_calculation") != "when_required"


class TlsContext:
    """The TLS context presigned GETs verify servers with: the CA bundle botocore would
    use, loaded on first use (and not pickled: an ``SSLContext`` does not pickle)."""

    def __init__(self, cafile: str | None) -> None:
        self.cafile = cafile
        self._made: ssl.SSLContext | None = None

    def __call__(self) -> ssl.SSLContext:
        if self._made is None:
            cafile = self.cafile
            if cafile is None:
                import certifi  # botocore's own default bundle

                cafile = certifi.where()
            self._made = ssl.create_default_context(cafile=cafile)
        return self._made

    def __getstate__(self) -> dict[str, Any]:
        return {"cafile": self.cafile, "_made": None}


def presigned_gets_tls(options: Mapping[str, Any], extra_kwargs: bool) -> TlsContext | None:
    """Whether ranged GETs may be presigned URLs on the lean HTTP client
    (:mod:`.httpget`), and if so the TLS context it verifies servers with. None where
    botocore would send anything a presigned URL leaves out: a proxy, request-payer
    or SSE-C headers (``extra_kwargs``), or no verification (``client_kwargs=
    {"verify": False}``). ``direct_gets=False`` and proxies in the environment are
    :class:`~cloudckpt.storage.transfer.ranges.StreamedRanges`' to judge, for every backend."""
    client = options.get("client_kwargs")
    client = client if isinstance(client, Mapping) else {}
    config = options.get("config_kwargs")
    config = config if isinstance(config, Mapping) else {}
    verify = client.get("verify", True)
    if extra_kwargs or verify is False or config.get("proxies"):
        return None
    return TlsContext(verify if isinstance(verify, str) else os.environ.get("AWS_CA_BUNDLE"))
