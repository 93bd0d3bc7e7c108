"""A draft made by eyas's own stages, for the vLLM test: the CLI exactly as a user runs it.

    chats (assistant turns = the target's greedy answers to the test prompts)
      -> eyas prepare (the real SmolLM2 tokenizer and chat template)
      -> eyas extract -> eyas train (offline; short, high learning rate: it overfits these chats
         on purpose, so its acceptance on them is far above 1) -> eyas export --format both

`chat_prompt_ids` renders the same prompts as the served requests (one user turn + the assistant
header), so vLLM and eyas decode exactly the contexts the draft was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

TRAIN_FLAGS = (
    "--train.ttt_steps=3", "--train.intermediate_size=256", "--train.max_tokens=512", "--train.lr=3e-3",
    "--train.warmup_steps=5", "--train.epochs=1000", "--train.max_steps=20", "--train.eval_fraction=0",
    "--train.save_every=0", "--train.log_every=20",
)  # fmt: skip
"""All chats in one micro-batch, so every optimizer step sees every answer; TTT steps = the k served."""


def chat_prompt_ids(tokenizer, prompts) -> list[list[int]]:
    """Each prompt as one user turn of the target's chat template, ending with the assistant header
    (rendered as text, then tokenised without special tokens: as `eyas prepare` tokenises a chat)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]  # fmt: skip
    return tokenizer(texts, add_special_tokens=False).input_ids


def write_answer_chats(path: Path, prompts, answers) -> Path:
    """OpenAI-form JSONL: one conversation per prompt, the target's answer as the assistant turn."""
    with open(path, "w", encoding="utf-8") as f:
        for p, a in zip(prompts, answers):
            f.write(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]}) + "\n")
    return path


def eyas(*argv: str) -> None:
    from eyas.cli import main

    rc = main(list(argv))
    assert rc == 0, f"`eyas {' '.join(argv)}` exited {rc}"


def trained_draft(run_dir: Path, target_dir: Path, chats: Path, k: int, draft_vocab: int = 512) -> dict[str, Path]:
    """prepare -> extract -> train -> export in `run_dir`; -> {layout: exported directory}."""
    common = (f"--run_dir={run_dir}", f"--target.model={target_dir}", "--target.dtype=float32")
    eyas("prepare", *common, f"--prepare.data={chats}", f"--prepare.draft_vocab_size={draft_vocab}", "--prepare.max_length=256")
    eyas("extract", *common, "--extract.progress=false")
    eyas("train", *common, *TRAIN_FLAGS)
    eyas("export", str(run_dir / "train"), "--format", "both", *common, f"--export.num_speculative_tokens={k}")
    return {fmt: run_dir / "export" / fmt for fmt in ("sglang", "speculators")}
