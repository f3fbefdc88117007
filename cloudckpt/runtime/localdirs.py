"""Where the local files of a run whose output key is a bucket URI go.

A framework derives more than checkpoints from its output key: logs, tracker files,
saved configs. Those are written with local file calls, so under activation a bucket
output key gives them a local directory named for the bucket instead of a directory
literally named ``s3:``: ``$CLOUDCKPT_LOCAL_DIR/<bucket>/<prefix>``, by default
``./cloudckpt-local/<bucket>/<prefix>`` below the working directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV_LOCAL_DIR", "DEFAULT_LOCAL_DIR", "local_dir_for"]

#: The directory under which a bucket output key's local files go.
ENV_LOCAL_DIR = "CLOUDCKPT_LOCAL_DIR"
DEFAULT_LOCAL_DIR = "cloudckpt-local"


def local_dir_for(uri: str, *, environ: Mapping[str, str] | None = None,
                  cwd: str | None = None) -> str:
    """The local directory (absolute) for the local files of output key ``uri``:
    ``s3://bucket/runs/a`` gives ``<root>/bucket/runs/a``. A local path is returned as
    it is (made absolute)."""
    env = os.environ if environ is None else environ
    base = cwd or os.getcwd()
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return os.path.abspath(os.path.join(base, uri))
    parts = [p for p in rest.split("/") if p not in ("", ".")]
    if ".." in parts or not parts:
        raise ValueError(f"{uri!r} has no bucket, or a '..' segment: no local directory "
                         "can be named for it")
    root = env.get(ENV_LOCAL_DIR) or DEFAULT_LOCAL_DIR
    return os.path.abspath(os.path.join(base, root, *parts))
