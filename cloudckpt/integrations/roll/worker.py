"""A worker's side of a ROLL upload: its attempt id, its part name, and the local files
it stages (a private snapshot, so a background upload survives ROLL deleting them)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

#: What a part name may not hold (each run of it becomes ``_``).
UNSAFE_PART_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def attempt_from_env() -> str:
    """The id shared by every process of one launch of the job, if one is known: under
    Ray, its job's id qualified by the cluster's session. A job id alone names the job
    within its cluster only: every fresh cluster numbers its first job ``01000000``,
    so a relaunch on a new Ray cluster would count the crashed launch's parts as its
    own."""
    explicit = os.environ.get("CLOUDCKPT_ATTEMPT_ID")
    if explicit:
        return explicit
    import sys

    ray = sys.modules.get("ray")
    if ray is not None:
        try:
            if ray.is_initialized():
                context = ray.get_runtime_context()
                job = str(context.get_job_id())
                session = getattr(context, "get_session_name", None)
                return f"{session()}/{job}" if session is not None else job
        except Exception:  # noqa: BLE001 - Ray without a job context
            pass
    return ""


def default_part_id(ckpt_id: str, local_state_path: str) -> str:
    """ROLL stages into ``{output_dir}/{worker_name}/{ckpt_id}``: the worker name
    ("pipeline", "actor_train-3") names the part, stably across restarts."""
    p = Path(local_state_path)
    if p.name == ckpt_id and p.parent.name:
        name = p.parent.name
    else:
        digest = hashlib.sha1(str(p).encode()).hexdigest()[:8]
        name = f"{socket.gethostname()}-{os.getpid()}-{digest}"
    return UNSAFE_PART_CHARS.sub("_", name).strip("._") or "part"


def local_files(root: Path) -> dict[str, Path]:
    """The files under ``root`` (or ``root`` itself, a file) by their relative key."""
    if root.is_file():
        return {root.name: root}
    if not root.is_dir():
        raise FileNotFoundError(f"nothing to upload: {root} does not exist")
    out: dict[str, Path] = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = Path(dirpath) / name
            out[full.relative_to(root).as_posix()] = full
    return out


def snapshot_dir(src: Path) -> Path:
    """Hard-link (or copy) ``src`` into a private staging directory beside it, so
    a background upload survives ROLL deleting ``src`` as soon as ``upload``
    returns. Linking is free; ROLL never modifies checkpoint files in place."""
    staging = src.parent / f".cloudckpt-staging-{src.name}-{uuid.uuid4().hex[:8]}"
    for rel, full in local_files(src).items():
        dst = staging / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(full, dst)
        except OSError:
            shutil.copy2(full, dst)
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def remove_path(path: Path) -> None:
    """Remove a file or a directory tree, whichever ``path`` is, if it is there."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink(missing_ok=True)


def restore_staged(staging: Path, original: Path) -> Path:
    """After a failed background upload: put the staged files back where ROLL wrote them
    when ROLL has deleted its copy (as its synchronous path keeps a copy it could not
    upload), else drop the snapshot. Either way no staging directory stays behind, and
    ROLL's own ``max_ckpt_to_keep`` keeps governing the local copy."""
    if not original.exists():
        try:
            os.replace(staging, original)
            return original
        except OSError:
            pass
    remove_path(staging)
    return original
