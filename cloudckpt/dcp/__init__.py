"""torch.distributed.checkpoint (DCP) straight to object storage.

``CloudStorageWriter``/``CloudStorageReader`` implement DCP's public
``StorageWriter``/``StorageReader``: the planner decides what to write, these
decide how. The on-store format is DCP's own (``__{rank}_{i}.distcp`` files of
``torch.save``-serialised items and a pickled ``.metadata``), so a checkpoint
copied to local disk loads with stock ``FileSystemReader``. On top of it:

- every rank uploads its files in parallel (multipart, several parts in flight);
- the coordinator writes ``.metadata`` and then the cloudckpt manifest,
  create-only, listing every rank's files with their CRC32C; no manifest, no
  checkpoint (a failed rank means no commit). A save onto a committed checkpoint
  replaces it (``overwrite=True``, torch's default) by compare-and-swap, its files
  under names of its own, the old ones deleted only after the swap;
- each item's CRC32C is recorded in the manifest, so readers verify exactly the
  bytes they fetch, even when resharding reads only parts of a file;
- ``.metadata`` is unpickled with an allowlist and byte items are checked with
  ``weights_only=True`` before DCP's planner sees them: nothing in a checkpoint
  can execute code on load.

One module per job, each importing only those listed after it:

- ``api``: ``save``/``load``/``async_save``, and DCP's ``CheckpointException``
  raised as cloudckpt's own errors;
- ``ranksave``: the indexed save (the default where the state allows): planned on
  every rank alone, checked in one all-reduce, each rank's records and the
  coordinator's index;
- ``stock``: a stock ``.metadata`` built from an indexed checkpoint's index and records;
- ``rankload``: the indexed load: each rank checks its state against the index, reads
  the records of the saved chunks it overlaps and plans alone;
- ``writer``: ``CloudStorageWriter``, items split into files, uploaded, committed;
- ``budget``: ``BudgetStager``, async saves' host staging within a budget;
- ``reader``: ``CloudStorageReader``, tensors read straight into their
  destinations, small items coalesced, every item checked;
- ``placement``: checked bytes into their destination tensors (straight, a few
  rows at a time converted, or through ``weights_only`` loading);
- ``readplan``: the items a load reads, and their grouping into ranged reads;
- ``adoption``: ``adopt``, committing a DCP checkpoint written without cloudckpt;
- ``indexread``: an indexed checkpoint's index and the records a load needs, read, and
  torch's ``Metadata`` of just those chunks;
- ``records``: the indexed format's index and per-rank chunk records, read as hostile
  input, and torch's ``Metadata`` built from them;
- ``rules``: a tensor's sharding as a rule (whole, or torch.chunk of one dimension);
- ``options``: torch's writer options (``thread_count``, ...), taken as cloudckpt's or
  refused saying why;
- ``base``: what the writer and the reader share;
- ``metadata``: the format's names, ``.metadata`` loaded safely, item checksums.

Unpickling lives in :mod:`cloudckpt.serialization`: ``.metadata``'s allowlist,
``weights_only`` loading, and where a tensor's bytes lie in a ``torch.save`` record.
"""

from cloudckpt.dcp.adoption import adopt
from cloudckpt.dcp.api import async_save, load, save
from cloudckpt.dcp.budget import BudgetStager, default_budget
from cloudckpt.dcp.metadata import METADATA_NAME, load_metadata
from cloudckpt.dcp.reader import CloudStorageReader
from cloudckpt.dcp.stock import stock_metadata
from cloudckpt.dcp.writer import CloudStorageWriter

__all__ = [
    "METADATA_NAME",
    "BudgetStager",
    "CloudStorageReader",
    "CloudStorageWriter",
    "adopt",
    "async_save",
    "default_budget",
    "load",
    "load_metadata",
    "save",
    "stock_metadata",
]
