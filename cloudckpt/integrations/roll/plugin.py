"""ROLL, as the core sees it: its kind and the directory of its part markers.
Plain data: importing it loads no torch."""

from cloudckpt.core.plugins import Framework

KIND = "roll"
#: Where each ROLL worker's part marker lies inside a checkpoint (one per part).
PARTS_DIR = "_cloudckpt_parts"

FRAMEWORK = Framework(
    name="roll",
    summary="ROLL runs: upload a local checkpoint-N, fetch the latest committed one",
    kinds=(KIND,),
    marker_dirs=(PARTS_DIR,),
    commands="cloudckpt.integrations.roll.cli:add_commands",
)
