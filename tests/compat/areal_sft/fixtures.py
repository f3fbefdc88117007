"""Everything AReaL's own SFT example needs, built offline into one directory.

    python tests/compat/areal_sft/fixtures.py DIR

writes

    DIR/model/          a tiny Qwen2ForCausalLM (random weights, seeded) and its tokenizer,
                        saved with ``save_pretrained`` (config.json, model.safetensors,
                        tokenizer.json, tokenizer_config.json with a chat template)
    DIR/data/gsm8k/     a GSM8K-shaped dataset laid out like the hub's ``openai/gsm8k``:
                        README.md declaring the config ``main`` with splits train/test,
                        main/train.jsonl and main/test.jsonl (fields ``question``, ``answer``)

AReaL 1.0.4's ``get_custom_dataset`` routes any path containing ``gsm8k`` with
``type: sft`` to ``areal.dataset.gsm8k.get_gsm8k_sft_dataset``, which calls
``datasets.load_dataset(path, name="main", split=...)``: the README's ``configs:`` block
is what makes ``name="main"`` resolve for a local directory.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

TRAIN_ROWS, TEST_ROWS = 64, 16
VOCAB_SIZE = 300
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2's chat template, shortened (no tools): AReaL's SFT path for gsm8k does not use it,
# but its RL datasets and workflows call ``apply_chat_template``.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ivan", "Zoe"]
THINGS = ["apples", "pens", "books", "coins", "cards", "stones"]


def gsm8k_rows(n: int, seed: int) -> list[dict[str, str]]:
    """GSM8K-shaped rows: a word problem, and a worked answer ending in '#### N'."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(1, 5)
        question = (f"{name} has {a} {thing} and buys {b} more. Then {name} gives away {c}. "
                    f"How many {thing} does {name} have now?")
        answer = (f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}.\n"
                  f"After giving away {c}, {name} has {a + b} - {c} = "
                  f"<<{a + b}-{c}={a + b - c}>>{a + b - c} {thing}.\n#### {a + b - c}")
        rows.append({"question": question, "answer": answer})
    return rows


def write_dataset(root: Path) -> Path:
    """``root/gsm8k``: README.md with a ``main`` config, main/{train,test}.jsonl."""
    ds = root / "gsm8k"
    (ds / "main").mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", TRAIN_ROWS, 0), ("test", TEST_ROWS, 1)):
        with open(ds / "main" / f"{split}.jsonl", "w") as f:
            for row in gsm8k_rows(n, seed):
                f.write(json.dumps(row) + "\n")
    (ds / "README.md").write_text(
        "---\n"
        "configs:\n"
        "- config_name: main\n"
        "  data_files:\n"
        "  - split: train\n"
        "    path: main/train.jsonl\n"
        "  - split: test\n"
        "    path: main/test.jsonl\n"
        "---\n"
        "A tiny GSM8K-shaped data set made by tests/compat/areal_sft/fixtures.py.\n"
    )
    return ds


def build_tokenizer(texts: list[str]):
    """A byte-level BPE trained on ``texts`` (no download), as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE, model_max_length=2048, padding_side="right")


def write_model(out: Path, tokenizer, seed: int = 0) -> Path:
    """A tiny Qwen2ForCausalLM, randomly initialised from ``seed``, and the tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build(root: str | Path) -> dict[str, str]:
    """Write model/ and data/gsm8k/ under ``root``; return their paths."""
    root = Path(root)
    ds = write_dataset(root / "data")
    texts = [r["question"] + r["answer"] for r in gsm8k_rows(TRAIN_ROWS, 0)]
    model = write_model(root / "model", build_tokenizer(texts))
    return {"model": str(model), "dataset": str(ds)}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIR")
    for key, path in build(sys.argv[1]).items():
        print(f"{key}={path}")
