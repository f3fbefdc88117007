"""AReaL, as the core sees it: the kind of its recover dumps. Plain data: importing
it loads no torch."""

from cloudckpt.core.plugins import Binding, Framework

#: The kind of a recover dump's generation (recover checkpoint and recover info).
KIND = "areal-recover"

#: AReaL's trainer modules (in ``areal.trainer``, whose ``__init__`` imports each), which
#: build ``Saver(config.saver, ft_spec)`` and ``RecoverHandler(config.recover, ft_spec)``
#: from names they imported.
TRAINERS = ("sft_trainer", "rl_trainer", "dpo_trainer", "rw_trainer")

FRAMEWORK = Framework(
    name="areal",
    summary="AReaL trials: import one from local disk, adopt one already in a bucket",
    kinds=(KIND,),
    commands="cloudckpt.integrations.areal.commands:add_commands",
    # The config (composed for every trainer and launcher), then the trainers, once the
    # package has imported all four.
    bindings=(Binding(module="areal.api.cli_args",
                      bind="cloudckpt.integrations.areal.binding:bind_config"),
              Binding(module="areal.trainer",
                      bind="cloudckpt.integrations.areal.binding:bind_trainers")),
    doctor="cloudckpt.integrations.areal.doctor:plan",
    distribution="areal",
    tested=("1.0.4",),
)
