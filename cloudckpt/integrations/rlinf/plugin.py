"""RLinf, as the core sees it: its kind, its parts and the DCP part a model
converts from. Plain data: importing it loads no torch."""

from cloudckpt.core.plugins import Binding, Framework
from cloudckpt.integrations.rlinf.layout import (
    ACTOR,
    CRITIC,
    DCP_DIR,
    KEY_PREFIX,
    KIND,
    PART_KIND,
)

FRAMEWORK = Framework(
    name="rlinf",
    summary="RLinf runs: upload, adopt and convert global_step_N checkpoints",
    kinds=(KIND, PART_KIND),
    # An RLinf save commits its actor and critic parts below its own claim.
    part_dirs=(ACTOR, CRITIC),
    # A model converts out of an RLinf step from its actor's DCP part.
    dcp_layouts={KIND: (f"{ACTOR}/{DCP_DIR}", KEY_PREFIX)},
    commands="cloudckpt.integrations.rlinf.commands:add_commands",
    doctor="cloudckpt.integrations.rlinf.doctor:plan",
    bindings=(Binding(module="rlinf.hybrid_engines.fsdp.strategy.base",
                      bind="cloudckpt.integrations.rlinf.binding:bind_strategy"),
              Binding(module="rlinf.runners.reasoning_runner",
                      bind="cloudckpt.integrations.rlinf.binding:bind_runner"),
              Binding(module="rlinf.utils.utils",
                      bind="cloudckpt.integrations.rlinf.binding:bind_launch")),
    distribution="rlinf",
    tested=("0.3.0",),
)
