"""verl, as the core sees it: its kinds and its parts. Plain data: importing it loads
no torch."""

from cloudckpt.core.plugins import Binding, Framework
from cloudckpt.integrations.verl.layout import ACTOR, CRITIC, HF_DIR, KIND, ROLE_KIND, SFT_KIND

FRAMEWORK = Framework(
    name="verl",
    summary="verl runs: global_step_N checkpoints committed to a bucket, resumed from it",
    kinds=(KIND, ROLE_KIND, SFT_KIND),
    # A PPO step commits its roles' parts below its own claim; a role and an SFT step
    # their HF export (hf_model in save_contents).
    part_dirs=(ACTOR, CRITIC, HF_DIR),
    commands="cloudckpt.integrations.verl.commands:add_commands",
    # With hf_model in save_contents, a role holds the model as an HF export.
    exports={KIND: f"{ACTOR}/{HF_DIR}", ROLE_KIND: HF_DIR, SFT_KIND: HF_DIR},
    export_setting="actor_rollout_ref.actor.checkpoint.save_contents: [..., hf_model]",
    bindings=(Binding(module="verl.utils.checkpoint.fsdp_checkpoint_manager",
                      bind="cloudckpt.integrations.verl.binding:bind_fsdp_manager"),
              Binding(module="verl.utils.checkpoint.megatron_checkpoint_manager",
                      bind="cloudckpt.integrations.verl.binding:bind_megatron_manager"),
              Binding(module="verl.trainer.ppo.ray_trainer",
                      bind="cloudckpt.integrations.verl.binding:bind_ppo_trainer"),
              Binding(module="verl.trainer.ppo.v1.trainer_base",
                      bind="cloudckpt.integrations.verl.binding:bind_ppo_trainer_v1"),
              Binding(module="verl.utils.checkpoint.checkpoint_handler",
                      bind="cloudckpt.integrations.verl.binding:bind_sft_handler")),
    doctor="cloudckpt.integrations.verl.doctor:plan",
    distribution="verl",
    tested=("0.9.1",),
)
