"""AReaL's ``Saver`` and ``RecoverHandler`` on cloudckpt: AReaL's calls, layout and
files, on any URI.

A drop-in: AReaL's trainer builds ``Saver(config.saver, ft_spec)`` and
``RecoverHandler(config.recover, ft_spec)`` and calls them as it always does; import
these two classes from here instead of ``areal.utils.saver``/``areal.utils.recover``
and ``fileroot`` may be a bucket URI (``s3://``, ``gs://``) or a local path. Both write
through the engine's own ``save``/``load`` (into a local staging directory that is
uploaded), so the bytes are exactly AReaL's:

- exports ``{name}/epoch{E}epochstep{S}globalstep{G}/``, each committed with a manifest;
- the recover state (``{name}/recover_checkpoint/`` and ``recover_info/``) as one
  generation of a :class:`~cloudckpt.training.slot.RecoverSlot` at the trial directory, so a
  crash mid-dump leaves the previous dump loadable.

``cloudckpt download`` of the trial directory writes AReaL's layout on local disk (AReaL's
own ``RecoverHandler`` resumes from it); ``cloudckpt areal import`` brings a trial
AReaL wrote on local disk into a bucket, and ``cloudckpt areal adopt`` commits one
AReaL wrote that is already there (which the handler otherwise refuses to resume).

The package: ``plugin`` (the declaration), ``binding`` (what activation binds),
``commands`` (``cloudckpt areal ...``), ``layout`` (where a trial's files go),
``resume`` (the ``RecoverHandler``), then one module per job: ``config`` (the
sections), ``yaml_loader``, ``freq`` (when to save), ``engines`` (AReaL's engine
interface, and an adapter for a plain model), ``info`` (the ``recover_info/`` files),
``saver``, ``preflight`` (the checks before training), ``importer``, ``adoption``,
``placement`` and ``dataorder`` (what activation changes), ``doctor`` (a launch, read)
and ``relaunch`` (:func:`run_with_retries`).
"""

from cloudckpt.util.lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "adoption": ("adopt_trial",),
    "config": ("RecoverConfig", "SaverConfig"),
    "engines": ("Engine", "ModuleEngine", "SaveLoadMeta"),
    "freq": ("FreqCtl",),
    "importer": ("import_trial",),
    "info": ("RecoverInfo",),
    "layout": (
        "EXPORT_RE",
        "export_name",
        "recover_checkpoint_uri",
        "recover_info_uri",
        "save_root",
    ),
    "resume": ("RecoverHandler", "read_dataloader_info"),
    "relaunch": ("run_with_retries",),
    "saver": ("Saver", "latest_export", "list_exports"),
    "yaml_loader": ("load_yaml",),
})

__all__ = [
    "EXPORT_RE",
    "Engine",
    "FreqCtl",
    "ModuleEngine",
    "RecoverConfig",
    "RecoverHandler",
    "RecoverInfo",
    "SaveLoadMeta",
    "Saver",
    "SaverConfig",
    "adopt_trial",
    "export_name",
    "import_trial",
    "latest_export",
    "list_exports",
    "load_yaml",
    "read_dataloader_info",
    "recover_checkpoint_uri",
    "recover_info_uri",
    "run_with_retries",
    "save_root",
]
