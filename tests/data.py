"""Chat data and prepare outputs for the tests (real records and the real tokenizer; no mocks).

* `write_sharegpt_chats`: the first n conversations of the embedded ShareGPT set, as JSONL.
* `write_synthetic_chats`: n ShareGPT-style conversations of varied lengths from a small word list.
* `write_shared_prefix_chats`: groups of conversations whose first user turns are equal (long
  shared prompt prefixes, for prefix caching).
* `write_answer_chats`: one OpenAI-form conversation per prompt, with a given answer.
* `chat_prompt_ids`: prompts as one user turn of a chat template, ending with the assistant header.
* `run_prepare`: `eyas prepare` on a chats file -> the prepare output directory.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from eyas.config import load_config

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbled boxes".split()


def write_sharegpt_chats(path: Path, n: int) -> Path:
    """The first `n` ShareGPT conversations (the embedded data set) as a JSONL file."""
    from eyas.assets import iter_json_array, sharegpt_path

    with open(path, "w", encoding="utf-8") as f:
        for i, rec in iter_json_array(sharegpt_path()):
            if i >= n:
                break
            f.write(json.dumps(rec) + "\n")
    return path


def write_synthetic_chats(path: str | Path, n: int, seed: int = 0, max_words: int = 120) -> Path:
    """n ShareGPT-style conversations of varied lengths (deterministic)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            turns = []
            for t in range(rng.choice([2, 2, 4])):
                k = rng.randint(3, max_words)
                turns.append({"from": "human" if t % 2 == 0 else "gpt", "value": " ".join(rng.choices(WORDS, k=k))})
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return Path(path)


def write_shared_prefix_chats(path: Path, groups: int, per_group: int, seed: int = 0) -> Path:
    """groups x per_group conversations; within a group the first user turn (~60-90 words) is the
    same, the rest differs, so prompts share long prefixes beyond the chat template's own."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for g in range(groups):
            question = " ".join(rng.choices(WORDS, k=rng.randint(60, 90)))
            for m in range(per_group):
                turns = [{"from": "human", "value": question},
                         {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))}]
                f.write(json.dumps({"id": f"g{g}m{m}", "conversations": turns}) + "\n")
    return path


def write_answer_chats(path: Path, prompts, answers) -> Path:
    """OpenAI-form JSONL: one conversation per prompt, the target's answer as the assistant turn."""
    with open(path, "w", encoding="utf-8") as f:
        for p, a in zip(prompts, answers):
            f.write(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]}) + "\n")
    return path


def chat_prompt_ids(tokenizer, prompts) -> list[list[int]]:
    """Each prompt as one user turn of the target's chat template, ending with the assistant header
    (rendered as text, then tokenised without special tokens: as `eyas prepare` tokenises a chat)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]  # fmt: skip
    return tokenizer(texts, add_special_tokens=False).input_ids


def run_prepare(run_dir: Path, chats: Path, max_length: int | None = None, draft_vocab: int | None = None,
                model: str | Path | None = None) -> Path:
    """`eyas prepare` of `chats` in `run_dir` (the target's model, max_length and draft vocabulary
    size where given, else the defaults) -> the prepare output directory."""
    from eyas.prepare import main as prepare

    flags = [f"--run_dir={run_dir}", f"--prepare.data={chats}"]
    flags += [f"--target.model={model}"] if model is not None else []
    flags += [f"--prepare.max_length={max_length}"] if max_length is not None else []
    flags += [f"--prepare.draft_vocab_size={draft_vocab}"] if draft_vocab is not None else []
    cfg = load_config(None, flags)
    prepare(cfg)
    return cfg.stage_dir("prepare")
