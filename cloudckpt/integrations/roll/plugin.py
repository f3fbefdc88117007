"""ROLL, as the core sees it: its kind and the directory of its part markers.
Plain data: importing it loads no torch."""

from cloudckpt.core.plugins import Binding, Framework
from cloudckpt.integrations.roll.layout import KIND, PARTS_DIR

FRAMEWORK = Framework(
    name="roll",
    summary="ROLL runs: upload a local checkpoint-N, fetch the latest committed one",
    kinds=(KIND,),
    marker_dirs=(PARTS_DIR,),
    commands="cloudckpt.integrations.roll.commands:add_commands",
    doctor="cloudckpt.integrations.roll.doctor:plan",
    # ROLL runs from its source tree: no version to read, so the code the binding
    # relies on (where the registries are read) is fingerprinted instead.
    bindings=(Binding(
        module="roll.utils.checkpoint_manager",
        bind="cloudckpt.integrations.roll.binding:bind_checkpoint_manager",
        fingerprint=("CheckpointManager.__init__", "CheckpointManager.upload",
                     "get_latest_ckpt", "download_model")),),
    tested=("sha256:ef488f0ec2a1c723",),  # ROLL 8eb27cc (../shared/peers)
)
