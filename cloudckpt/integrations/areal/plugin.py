"""AReaL, as the core sees it: the kind of its recover dumps. Plain data: importing
it loads no torch."""

from cloudckpt.core.plugins import Framework

#: The kind of a recover dump's generation (recover checkpoint and recover info).
KIND = "areal-recover"

FRAMEWORK = Framework(
    name="areal",
    summary="AReaL trials: import one from local disk, adopt one already in a bucket",
    kinds=(KIND,),
    commands="cloudckpt.integrations.areal.commands:add_commands",
)
