"""Real inputs for the train tests: a prepare output on real chats, real SmolLM2 hidden states, a
tiny random-weight Llama target saved as an ordinary HF directory (no mocks anywhere)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eyas.config import EyasConfig, load_config

VOCAB = 49152


def write_chats(path: Path, n: int) -> Path:
    """The first `n` ShareGPT conversations (the embedded data set) as a JSONL file."""
    from eyas.assets import iter_json_array, sharegpt_path

    with open(path, "w", encoding="utf-8") as f:
        for i, rec in iter_json_array(sharegpt_path()):
            if i >= n:
                break
            f.write(json.dumps(rec) + "\n")
    return path


def run_prepare(run_dir: Path, chats: Path, max_length: int, draft_vocab: int, model: str = "embedded:smollm2") -> Path:
    from eyas.prepare import main as prepare

    cfg = load_config(None, [f"--run_dir={run_dir}", f"--target.model={model}", f"--prepare.data={chats}",
                             f"--prepare.max_length={max_length}", f"--prepare.draft_vocab_size={draft_vocab}"])
    prepare(cfg)
    return cfg.stage_dir("prepare")


def save_tiny_llama(out: Path, tokenizer_dir: Path, seed: int = 0, hidden: int = 64, layers: int = 6) -> Path:
    """A tiny random Llama (SmolLM2's vocab, tokenizer and chat template) as an HF model dir."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=False)
    model = LlamaForCausalLM(conf)
    with torch.no_grad():  # std 0.02 leaves the residual stream tiny; larger weights make layers matter
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0, 0.08)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out


class InMemoryStates:
    """An offline source held in memory: prepare samples + the target's states from a plain
    `model(..., output_hidden_states=True)` forward, one sample at a time (no eyas capture code)."""

    def __init__(self, prepared, model, layer_ids: list[int], max_samples: int = 0):
        n = min(len(prepared), max_samples) if max_samples else len(prepared)
        self.samples = []
        with torch.no_grad():
            for i in range(n):
                s = prepared[i]
                out = model(input_ids=s["input_ids"][None], output_hidden_states=True, use_cache=False)
                hs = out.hidden_states  # hs[k] enters layer k; hs[-1] is the final-norm output
                aux = torch.stack([hs[k][0] for k in layer_ids], dim=1)
                self.samples.append(dict(s, aux=aux, final=hs[-1][0]))
        self.lengths = torch.tensor([s["input_ids"].numel() for s in self.samples])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return self.samples[i]


def train_config(run_dir: Path, *overrides: str) -> EyasConfig:
    return load_config(None, [f"--run_dir={run_dir}", *overrides])


def read_metrics(train_dir: Path, split: str = "train") -> list[dict]:
    recs = [json.loads(ln) for ln in (train_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in recs if r["split"] == split]
