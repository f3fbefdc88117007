"""AReaL's ``Saver``: committed Hugging Face exports, and listing them."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ... import coordination as coord
from ... import hf
from ...checkpoint import Checkpoint, open_checkpoint
from ...listing import list_checkpoints
from ...manifest import MANIFEST_NAME
from ...storage import open_store
from .config import EXPORT_RE, RecoverConfig, SaverConfig, export_name, save_root
from .engines import _as_engine, _full_model_state, _is_sharded
from .freq import _Periodic

log = logging.getLogger("cloudckpt")


class Saver(_Periodic):
    """AReaL's ``Saver``: a Hugging Face export of the model when due, each to a new
    ``{name}/epoch{E}epochstep{S}globalstep{G}/`` committed with a manifest (a crash
    mid-export leaves an invisible prefix that :func:`latest_export` skips)."""

    def __init__(self, config: SaverConfig, steps_per_epoch: int, *,
                 storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None) -> None:
        super().__init__(config, steps_per_epoch, storage_options, process_group)
        if config.mode == "async":
            log.warning("saver mode 'async' applies to AReaL's Archon engine only; HF exports "
                        "here are synchronous (as AReaL does for other engines)")

    def export_uri(self, epoch: int, epoch_step: int, global_step: int,
                   name: str = "default") -> str:
        return f"{save_root(self.config)}/{name}/{export_name(epoch, epoch_step, global_step)}"

    def save(self, engine: Any, epoch: int, step: int, global_step: int, *,
             name: str = "default", tokenizer: Any = None,
             config: Mapping[str, Any] | Any | None = None) -> str | None:
        """Export when due (AReaL's arguments: ``step`` is the step within the epoch).
        Call on every rank; rank 0 writes. Returns the export URI when one was written."""
        if not self.freq_ctl.check(epochs=int(step == self.steps_per_epoch - 1), steps=1):
            return None
        eng = _as_engine(engine)
        uri = self.export_uri(epoch, step, global_step, name)
        # A sharded (FSDP2) model is gathered on every rank; a plain one is exported
        # as itself, so transformers' tied weights and generation config are honoured.
        model: Any = _full_model_state(eng.model) if _is_sharded(eng.model) else eng.model
        if config is None:
            config = getattr(eng.model, "config", None)
        def export() -> None:
            if open_store(uri, self.storage_options).exists(MANIFEST_NAME):
                # Exported before a crash that came before the next recover dump:
                # the run resumed earlier and reached this step again.
                log.info("%s was exported before a restart; keeping it", uri)
            else:  # this job owns its exports: a crashed attempt's claim is ours
                hf.export(model, uri, config=config, tokenizer=tokenizer,
                          storage_options=self.storage_options, takeover=True,
                          metadata={"step_info": {"epoch": epoch, "epoch_step": step,
                                                  "global_step": global_step}})

        coord.on_coordinator(export, self.group)
        return uri

    def state_dict(self) -> dict[str, Any]:
        return self.freq_ctl.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state)


def list_exports(cfg: SaverConfig | RecoverConfig, name: str = "default", *,
                 storage_options: Mapping[str, Any] | None = None) -> list[Checkpoint]:
    """The committed exports of engine ``name``, oldest global step first. Torn
    exports (no manifest) are not listed."""
    root = f"{save_root(cfg)}/{name}"
    found = []
    for info in list_checkpoints(root, storage_options):
        m = EXPORT_RE.match(info.name)
        if m:
            found.append((int(m.group(3)), info.uri))
    return [open_checkpoint(uri, storage_options) for _, uri in sorted(found)]


def latest_export(cfg: SaverConfig | RecoverConfig, name: str = "default", *,
                  storage_options: Mapping[str, Any] | None = None) -> Checkpoint | None:
    """The committed export with the highest global step, or None."""
    exports = list_exports(cfg, name, storage_options=storage_options)
    return exports[-1] if exports else None
