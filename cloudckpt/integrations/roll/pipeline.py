"""ROLL's driver pipeline, read (never patched): the one place that knows the shape of
ROLL's objects, so that the pipeline's part can name every checkpoint cluster.

ROLL's ``BasePipeline.__init__`` builds ``self.checkpoint_manager =
CheckpointManager(...)``, which builds this uploader; ``set_checkpoint_clusters`` fills
the pipeline's ``checkpoint_clusters`` list (ROLL's ``Cluster`` objects, each with its
``cluster_name`` and ``world_size``), and ``do_checkpoint`` calls every checkpoint
cluster's ``do_checkpoint`` before the pipeline's own ``upload``. So the uploader built
by a pipeline finds it among the frames constructing it, and, at each upload of the
pipeline's part, reads the clusters the pipeline has then. Elsewhere (a worker's
manager, or a CheckpointManager driven by hand) nothing is found and nothing is read.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any

log = logging.getLogger(__name__)

#: How many frames above the uploader's constructor a pipeline is looked for: the
#: uploader's own ``__init__`` chain, a registry wrapper, ``CheckpointManager.__init__``
#: and the pipeline's ``__init__`` chain (a subclass calling ``super().__init__``).
_DEPTH = 12

Pipeline = weakref.ReferenceType  # a weak reference to ROLL's pipeline object


def _is_pipeline(obj: Any) -> bool:
    """``BasePipeline``'s shape: a ``checkpoint_clusters`` list and ``do_checkpoint``."""
    return (isinstance(getattr(obj, "checkpoint_clusters", None), list)
            and callable(getattr(obj, "do_checkpoint", None)))


def constructing() -> Pipeline | None:
    """The ROLL pipeline whose constructor is building the caller (weakly held: the
    uploader never keeps the pipeline alive), or None."""
    frame = inspect.currentframe()  # this function's; its caller's is the uploader's
    frame = frame.f_back if frame is not None else None
    for _ in range(_DEPTH):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and _is_pipeline(owner):
            try:
                return weakref.ref(owner)
            except TypeError:  # a pipeline without weak references: keep the plain rule
                return None
    return None


def checkpoint_clusters(pipeline: Pipeline) -> dict[str, int] | None:
    """``{cluster_name: world_size}`` of the pipeline's checkpoint clusters now; None when
    the pipeline is gone, has none, or one of them cannot be read (a WARNING says so:
    the checkpoint then commits by the rule without them)."""
    owner = pipeline()
    if owner is None:
        return None
    out: dict[str, int] = {}
    for cluster in list(owner.checkpoint_clusters):
        name, world = getattr(cluster, "cluster_name", None), getattr(cluster, "world_size",
                                                                      None)
        if not isinstance(name, str) or not name or not isinstance(world, int) or world < 1:
            log.warning("ROLL's pipeline has a checkpoint cluster without a cluster_name "
                        "and a world_size (%r): its checkpoints commit once the parts that "
                        "arrive are whole, without naming every cluster", cluster)
            return None
        out[name] = world
    return out or None
