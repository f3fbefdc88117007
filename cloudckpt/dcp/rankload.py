"""Loading an indexed DCP checkpoint rank by rank, with no plan of the whole job.

The coordinator reads the manifest and the index (:meth:`CloudStorageReader.open_for_load`)
and shares them. Each rank then works out from its own state which chunks it loads
(DCP's local save plan of the state: each tensor's boxes, each other value's name),
checks them against the index (a name or shape the checkpoint lacks is refused on
every rank before any data is read), reads the records of those chunks (the saved
ranks holding them and the tensors needed of each:
:func:`~cloudckpt.dcp.indexread.holders`; on the layout it was saved with, its own
records only; a file it needs a few records of, by range) and primes its reader with
the ``Metadata`` of just them. torch's
``dcp.load`` then plans and reads on each rank alone (``no_dist``): nothing is gathered,
and each item is still checked against its CRC32C. Once every rank's state has passed,
the coordinator reads the small items held whole (replicated values every rank loads)
and sends them to all, so a job reads them once, not once per rank.

The names are those of DCP's default planners (nested state flattened to dotted
names): a load planner naming items otherwise finds them missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlanner, WriteItemType

from cloudckpt.dcp.indexread import Box, Needs, holders, metadata_for, read_records
from cloudckpt.dcp.reader import CloudStorageReader, IndexedStart
from cloudckpt.dcp.records import Index
from cloudckpt.errors import CorruptCheckpointError, StateMismatchError
from cloudckpt.runtime import coordination as coord


def local_needs(state_dict: Mapping[str, Any]) -> Needs:
    """What ``state_dict`` loads on this rank, named as DCP's default planners name it:
    each tensor's global size and local boxes, each other value's name."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(state_dict), is_coordinator=True)
    tensors: dict[str, tuple[tuple[int, ...], list[Box]]] = {}
    byte_items = set()
    for item in planner.create_local_plan().items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            byte_items.add(fqn)
            continue
        chunk = item.tensor_data.chunk
        _, boxes = tensors.setdefault(fqn, (tuple(item.tensor_data.size), []))
        boxes.append((tuple(chunk.offsets), tuple(chunk.sizes)))
    return Needs(tensors, frozenset(byte_items))


def check_needs(index: Index, needs: Needs, *, uri: str, partial: bool) -> None:
    """Refuse a state the checkpoint cannot fill (:class:`StateMismatchError` naming the
    key): a name it lacks (unless ``partial``), another shape, a tensor where it holds
    another value or the reverse."""
    shapes = {t.fqn: t.size for t in index.tensors}
    values = {b.fqn for b in index.byte_items}
    for fqn, (size, _) in sorted(needs.tensors.items()):
        saved = shapes.get(fqn)
        if saved is not None and saved != size:
            raise StateMismatchError(
                f"loading {uri}: {fqn} has shape {saved} in the checkpoint but {size} in the "
                "state to load into. The model (or optimizer) does not match the checkpoint: "
                "build it with the configuration it was saved with.")
        if fqn in values:
            raise StateMismatchError(
                f"loading {uri}: {fqn} is a tensor in the state to load into but another "
                "value in the checkpoint; the state does not match the checkpoint")
        if saved is None and not partial:
            raise _missing(uri, fqn)
    for fqn in sorted(needs.byte_items):
        if fqn in shapes:
            raise StateMismatchError(
                f"loading {uri}: {fqn} is a tensor of shape {shapes[fqn]} in the checkpoint "
                "but another value in the state to load into; the state does not match the "
                "checkpoint")
        if fqn not in values and not partial:
            raise _missing(uri, fqn)


def _missing(uri: str, fqn: str) -> StateMismatchError:
    return StateMismatchError(
        f"loading {uri}: the state to load into has {fqn}, which the checkpoint lacks. The "
        "model does not match the checkpoint; load with a matching model, or drop the key "
        "(or pass a planner allowing partial loads, e.g. DefaultLoadPlanner("
        "allow_partial_load=True)).")


def prepare(state_dict: Mapping[str, Any], reader: CloudStorageReader, start: IndexedStart,
            *, planner: LoadPlanner | None = None, group: Any = None) -> None:
    """Prime ``reader`` (opened by :meth:`~CloudStorageReader.open_for_load`) for this
    rank's load of ``state_dict``: its state checked against the index, the records it
    needs read, their ``Metadata`` built. Every rank of ``group`` calls it; a failure on
    any raises on every one (nothing was loaded anywhere)."""
    ckpt = reader.checkpoint
    if ckpt is None:
        raise CorruptCheckpointError(f"{reader.uri}: the checkpoint was not opened", {})
    partial = bool(getattr(planner, "allow_partial_load", False))

    def plan() -> tuple[Any, Any]:
        needs = local_needs(state_dict)
        check_needs(start.index, needs, uri=reader.uri, partial=partial)
        records = read_records(ckpt, start.index, holders(start.index, needs))
        return metadata_for(start.index, records, [*needs.tensors, *needs.byte_items])

    md, crcs = coord.checked(plan, group)
    # Every rank's state matched: now the replicated small items, read once for the job.
    shared = coord.on_coordinator(lambda: reader.read_whole_items(start.index), group)
    reader.prime(md, ckpt, crcs, shared)
