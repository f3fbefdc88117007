"""huggingface_hub's internal: the LFS batch request.

Not underscored, but not in huggingface_hub's documented API either (``huggingface_hub.
lfs`` is the module its commit code uses): a push asks the Hub's LFS batch endpoint which
objects it lacks, before any commit, so that a push run again after an interruption
sends only those. ``HfApi.preupload_lfs_files`` makes the same request but does not say
what it found.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cloudckpt.compat import Internal

INTERNALS = {
    "huggingface_hub.lfs.post_lfs_batch_info": Internal(
        "which LFS objects the Hub already has (no upload action) and which it refuses, "
        "asked before any commit"),
}


def lfs_batch(upload_infos: Iterable[Any], token: str | None, repo_id: str, endpoint: str,
              revision: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``huggingface_hub.lfs.post_lfs_batch_info`` for a model repo: the batch answer's
    objects with actions (or none: the Hub has them) and its objects with errors."""
    from huggingface_hub.lfs import post_lfs_batch_info

    answer = post_lfs_batch_info(list(upload_infos), token, "model", repo_id,
                                 revision=revision, endpoint=endpoint)
    return list(answer[0]), list(answer[1])
