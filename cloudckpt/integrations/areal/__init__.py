"""AReaL's ``Saver`` and ``RecoverHandler`` on cloudckpt: same keys, same layout, any URI.

AReaL writes everything below ``{fileroot}/checkpoints/{user}/{experiment}/{trial}/``:
Hugging Face exports ``{name}/epoch{E}epochstep{S}globalstep{G}/`` (the ``Saver``), a
recover checkpoint ``{name}/recover_checkpoint/`` overwritten by every dump and the
``recover_info/`` files describing it (the ``RecoverHandler``). Here ``fileroot`` may be
a bucket URI (``s3://``, ``gs://``) or a local path, and the recover checkpoint is a
:class:`~cloudckpt.slot.RecoverSlot`: each dump commits a new generation holding the
weights, the optimizer, the RNG states, every rank's dataloader state *and* AReaL's
recover info, then swaps the slot's pointer. Weights and recover info therefore can never
disagree, and a crash mid-dump leaves the previous dump loadable. ``recover_info/`` is
still written, after the swap, as a mirror in AReaL's file names for tools and people
who look there; :meth:`RecoverHandler.load` reads the slot, and treats a missing
``recover_info/`` as AReaL's documented "clean restart".

The package has one module per job: ``config`` (the ``saver:``/``recover:`` sections and
the paths they name), ``yaml_loader`` (AReaL's experiment YAML), ``freq`` (when to save),
``engines`` (what an engine contributes), ``saver`` (the ``Saver``), ``recover`` (the
``RecoverHandler``) and ``relaunch`` (:func:`run_with_retries`).
"""

# EXPORT_RE, INFO_FILES and read_dataloader_info are public but, as before the split,
# not in __all__ (hence the ``X as X`` re-exports).
from .config import EXPORT_RE as EXPORT_RE
from .config import (
    RecoverConfig,
    SaverConfig,
    export_name,
    recover_checkpoint_uri,
    recover_info_uri,
    save_root,
)
from .engines import Engine
from .freq import FreqCtl
from .recover import INFO_FILES as INFO_FILES
from .recover import RecoverHandler, RecoverInfo
from .recover import read_dataloader_info as read_dataloader_info
from .relaunch import run_with_retries
from .saver import Saver, latest_export, list_exports
from .yaml_loader import load_yaml

__all__ = [
    "Engine",
    "FreqCtl",
    "RecoverConfig",
    "RecoverHandler",
    "RecoverInfo",
    "Saver",
    "SaverConfig",
    "export_name",
    "latest_export",
    "list_exports",
    "load_yaml",
    "recover_checkpoint_uri",
    "recover_info_uri",
    "run_with_retries",
    "save_root",
]
