"""verl's names: the ``global_step_N/`` layout of ``trainer.default_local_dir``, its
role directories, each rank's files and the tracker (verl 0.9.1,
``verl/trainer/ppo/ray_trainer.py`` and ``verl/utils/checkpoint/``)."""

from __future__ import annotations

import re

from cloudckpt.errors import ConfigError

#: A committed step: the roles' parts and ``data.pt``.
KIND = "verl"
#: One role's part (``actor/``, ``critic/``), committed by that role's workers.
ROLE_KIND = "verl-role"
#: A step of verl's SFT trainer (``CheckpointHandler``): the engine's checkpoint
#: manager's files at the step's root, beside each data-parallel rank's
#: ``data_{dp_rank}.pt``.
SFT_KIND = "verl-sft"
#: What a ``global_step_N`` of a run's root is: a PPO step or an SFT one.
STEP_KINDS = (KIND, SFT_KIND)
STEP_PREFIX = "global_step_"
ACTOR = "actor"
CRITIC = "critic"
#: Where a role's HF config, tokenizer and (with ``hf_model``) model go.
HF_DIR = "huggingface"
#: The driver's dataloader state, at the step's root.
DATA = "data.pt"
#: How a role's files were written (the part's ``layout`` metadata): per-rank
#: ``torch.save`` files of the FSDP manager, which cannot be resharded, or the Megatron
#: manager's ``dist_ckpt`` directories, which its own load reshards.
FSDP_LAYOUT = "verl-fsdp"
MEGATRON_LAYOUT = "verl-megatron"
#: What verl's checkpoint managers save and load when ``checkpoint_config`` names nothing.
DEFAULT_CONTENTS = ("model", "optimizer", "extra")
#: What verl's Megatron manager writes last in a role directory: its contents.
MEGATRON_CONTENTS = "ckpt_contents.json"
#: The SFT trainer's dataloader state, one per data-parallel rank.
SFT_DATA = "data_{dp_rank}.pt"
#: The SFT trainer's LoRA rank and alpha, when it trains LoRA adapters.
LORA_META = "lora_train_meta.json"
#: verl's tracker at the root: the number of the newest step, as text.
TRACKER = "latest_checkpointed_iteration.txt"
#: Each rank's files in a role directory (``FSDPCheckpointManager``).
RANK_FILES = {"model": "model_world_size_{world}_rank_{rank}.pt",
              "optimizer": "optim_world_size_{world}_rank_{rank}.pt",
              "extra": "extra_state_world_size_{world}_rank_{rank}.pt"}
_RANK_FILE_RE = re.compile(r"^(?:model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{int(step)}"


def rank_file(content: str, world: int, rank: int) -> str:
    """The file of ``content`` (``model``, ``optimizer``, ``extra``) of one rank."""
    return RANK_FILES[content].format(world=world, rank=rank)


def rank_file_world(name: str) -> int | None:
    """The world size a rank file was saved by, from its name (None: not one)."""
    m = _RANK_FILE_RE.match(name.rpartition("/")[2])
    return int(m.group(1)) if m else None


def parse_step(uri: str) -> int:
    """The step of ``.../global_step_N`` (a trailing slash is fine).

    verl takes ``int(path.split("global_step_")[-1])``; the same names parse here,
    anything else is refused by name instead of a bare ``ValueError``."""
    step = step_named(uri)
    if step is None:
        raise ConfigError(f"{uri!r} does not end in {STEP_PREFIX}<N>: verl takes the resumed "
                          "step from that name (trainer.resume_from_path must name a step)")
    return step


def step_named(uri: str) -> int | None:
    """The step of ``.../global_step_N`` (None when not named so)."""
    m = STEP_RE.match(str(uri).rstrip("/").rpartition("/")[2])
    return int(m.group(1)) if m else None


def step_of_role(uri: str) -> int | None:
    """The step of ``.../global_step_N/<role>`` (None when not named so)."""
    return step_named(str(uri).rstrip("/").rpartition("/")[0])
