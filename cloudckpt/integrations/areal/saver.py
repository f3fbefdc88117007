"""AReaL's ``Saver``: Hugging Face exports, each committed with a manifest."""

from __future__ import annotations

import getpass
import logging
import os
from collections.abc import Mapping
from typing import Any

from cloudckpt.core import blobs
from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.listing import list_checkpoints
from cloudckpt.core.manifest import MANIFEST_NAME
from cloudckpt.hf import KIND as HF_KIND
from cloudckpt.integrations.areal.engines import as_engine, save_load_meta
from cloudckpt.integrations.areal.freq import Periodic
from cloudckpt.integrations.areal.layout import EXPORT_RE, export_name, save_root
from cloudckpt.integrations.areal.preflight import check_trial
from cloudckpt.runtime import coordination as coord
from cloudckpt.storage import open_store
from cloudckpt.training.staging import staging_dir, upload_dir

log = logging.getLogger(__name__)


def _dir(*parts: str) -> str:
    """Join path parts as AReaL does; a local directory is created, as AReaL's are."""
    path = "/".join([parts[0].rstrip("/"), *parts[1:]])
    if "://" not in path:
        path = os.path.join(*parts)
        os.makedirs(path, exist_ok=True)
    return path


class Saver(Periodic):
    """AReaL's ``Saver(config, ft_spec)``: ``save`` exports the model through the
    engine's own ``save`` when due, into ``{name}/epoch{E}epochstep{S}globalstep{G}/``
    (a bucket URI or a local path), committed with a manifest, so a crash mid-export
    leaves a prefix that no reader trusts.

    ``config`` is AReaL's ``SaverConfig`` (or this package's); ``ft_spec`` AReaL's
    ``FinetuneSpec`` (or the number of steps per epoch). The engine writes into a local
    staging directory (``staging`` or ``$CLOUDCKPT_STAGING`` or the temp dir), which is
    then uploaded and removed. Exports are synchronous, as AReaL's are for every engine
    but Archon: ``is_async`` is False. A missing bucket or refused credentials raise
    here, before any training, not at the first export.
    """

    def __init__(self, config: Any, ft_spec: Any, *,
                 storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None, staging: str | None = None) -> None:
        super().__init__(config, ft_spec, storage_options, process_group)
        coord.on_coordinator(lambda: check_trial(config, self.storage_options, recover=False),
                             process_group)
        self.staging = staging
        self.last_export: str | None = None
        if config.mode == "async":
            log.warning("saver mode 'async' applies to AReaL's Archon engine only; exports "
                        "here are synchronous (as AReaL does for other engines)")

    # ------------------------------------------------------- AReaL's path helpers

    @staticmethod
    def get_save_root(experiment_name: str, trial_name: str, fileroot: str) -> str:
        return _dir(f"{fileroot}/checkpoints/{getpass.getuser()}/{experiment_name}/"
                    f"{trial_name}")

    @staticmethod
    def get_model_save_root(experiment_name: str, trial_name: str, fileroot: str,
                            name: str = "default") -> str:
        return _dir(Saver.get_save_root(experiment_name, trial_name, fileroot), name)

    @staticmethod
    def get_model_save_path(experiment_name: str, trial_name: str, fileroot: str,
                            epoch: int, step: int, globalstep: int,
                            name: str = "default") -> str:
        return _dir(Saver.get_model_save_root(experiment_name, trial_name, fileroot, name),
                    export_name(epoch, step, globalstep))

    @staticmethod
    def get_recover_checkpoint_path(experiment_name: str, trial_name: str, fileroot: str,
                                    name: str = "default") -> str:
        return _dir(Saver.get_model_save_root(experiment_name, trial_name, fileroot, name),
                    "recover_checkpoint")

    def export_uri(self, epoch: int, epoch_step: int, global_step: int,
                   name: str = "default") -> str:
        return f"{self.root}/{name}/{export_name(epoch, epoch_step, global_step)}"

    # ------------------------------------------------------------------ saving

    def save(self, engine: Any, epoch: int, step: int, global_step: int,
             name: str = "default", tokenizer: Any = None, processor: Any = None,
             base_model_path: str | None = None) -> None:
        """Export when due (``step`` is the step within the epoch); call on every rank.
        The URI written is kept in :attr:`last_export`."""
        if not self.freq_ctl.check(epochs=self.epoch_ends(step), steps=1):
            return
        uri = self.export_uri(epoch, step, global_step, name)
        done = coord.on_coordinator(
            lambda: open_store(uri, self.storage_options).exists(MANIFEST_NAME), self.group)
        if done:
            # Exported before a crash that came before the next recover dump: the run
            # resumed earlier and reached this step again.
            log.info("%s was exported before a restart; keeping it", uri)
        else:
            eng = as_engine(engine)
            with staging_dir(self.staging, self.group) as local:
                eng.save(save_load_meta(path=str(local), weight_format="hf", with_optim=False,
                                        tokenizer=tokenizer, processor=processor,
                                        base_model_path=base_model_path))
                # This job owns its export directories: a crashed attempt's claim is ours.
                upload_dir(local, uri, group=self.group, storage_options=self.storage_options,
                           kind=HF_KIND, step=global_step, takeover=True,
                           incremental=blobs.requested(None), metadata={
                               "step_info": {"epoch": epoch, "epoch_step": step,
                                             "global_step": global_step}})
        self.last_export = uri

    @property
    def is_async(self) -> bool:
        return False

    def maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: exports are synchronous."""

    def finalize(self) -> None:
        """Nothing pending at the end of training: every export has committed."""

    def state_dict(self) -> dict[str, Any]:
        return self.freq_ctl.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state_dict)


def list_exports(cfg: Any, name: str = "default", *,
                 storage_options: Mapping[str, Any] | None = None) -> list[Checkpoint]:
    """The committed exports of engine ``name``, oldest global step first. Torn
    exports (no manifest) are not listed."""
    found = []
    for info in list_checkpoints(f"{save_root(cfg)}/{name}", storage_options):
        m = EXPORT_RE.match(info.name)
        if m:
            found.append((int(m.group(3)), info.uri))
    return [open_checkpoint(uri, storage_options) for _, uri in sorted(found)]


def latest_export(cfg: Any, name: str = "default", *,
                  storage_options: Mapping[str, Any] | None = None) -> Checkpoint | None:
    """The committed export with the highest global step, or None."""
    exports = list_exports(cfg, name, storage_options=storage_options)
    return exports[-1] if exports else None
