"""torch.distributed.checkpoint (DCP) straight to object storage.

``CloudStorageWriter``/``CloudStorageReader`` implement DCP's public
``StorageWriter``/``StorageReader``: the planner decides what to write, these
decide how. The on-store format is DCP's own (``__{rank}_{i}.distcp`` files of
``torch.save``-serialised items and a pickled ``.metadata``), so a checkpoint
copied to local disk loads with stock ``FileSystemReader``. On top of it:

- every rank uploads its files in parallel (multipart, several parts in flight);
- the coordinator writes ``.metadata`` and then the cloudckpt manifest,
  create-only, listing every rank's files with their CRC32C; no manifest, no
  checkpoint (a failed rank means no commit);
- each item's CRC32C is recorded in the manifest, so readers verify exactly the
  bytes they fetch, even when resharding reads only parts of a file;
- ``.metadata`` is unpickled with an allowlist and byte items are checked with
  ``weights_only=True`` before DCP's planner sees them: nothing in a checkpoint
  can execute code on load.

One module per job, each importing only those listed after it:

- ``api``: ``save``/``load``/``async_save``, and DCP's ``CheckpointException``
  raised as cloudckpt's own errors;
- ``writer``: ``CloudStorageWriter``, items split into files, uploaded, committed;
- ``budget``: ``BudgetStager``, async saves' host staging within a budget;
- ``reader``: ``CloudStorageReader``, tensors read straight into their
  destinations, small items coalesced, every item checked;
- ``records``: where a tensor's bytes lie inside a ``torch.save`` record;
- ``adoption``: ``adopt``, committing a DCP checkpoint written without cloudckpt;
- ``base``: what the writer and the reader share;
- ``metadata``: the format's names and the safe unpickling of ``.metadata``.
"""

# __all__, plus the constants other code has always found here (not in __all__).
from cloudckpt.dcp.adoption import adopt
from cloudckpt.dcp.api import async_save, load, save
from cloudckpt.dcp.budget import BudgetStager, default_budget
from cloudckpt.dcp.metadata import DCP_KIND as DCP_KIND
from cloudckpt.dcp.metadata import METADATA_NAME as METADATA_NAME
from cloudckpt.dcp.metadata import SUFFIX as SUFFIX
from cloudckpt.dcp.metadata import load_metadata
from cloudckpt.dcp.reader import COALESCE_GAP as COALESCE_GAP
from cloudckpt.dcp.reader import DEFAULT_READ_WINDOW as DEFAULT_READ_WINDOW
from cloudckpt.dcp.reader import CloudStorageReader
from cloudckpt.dcp.writer import DEFAULT_FILE_SIZE as DEFAULT_FILE_SIZE
from cloudckpt.dcp.writer import DEFAULT_MAX_FILES as DEFAULT_MAX_FILES
from cloudckpt.dcp.writer import CloudStorageWriter

__all__ = [
    "BudgetStager",
    "CloudStorageReader",
    "CloudStorageWriter",
    "adopt",
    "async_save",
    "default_budget",
    "load",
    "load_metadata",
    "save",
]
