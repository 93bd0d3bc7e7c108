"""Shared by the train tests: configs, the first optimizer step of a run, the metrics log, and
`InMemoryStates` (the target's states from plain HF forwards: the reference for the states training reads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eyas.config import EyasConfig, load_config
from eyas.train import build


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


def tiny_cfg(run_dir, prep, target, *extra):
    return train_config(
        run_dir, f"--prepare.out_dir={prep}", f"--target.model={target}", "--train.ttt_steps=3",
        "--train.max_tokens=128", "--train.lr=1e-3", "--train.eval_fraction=0", "--train.log_every=1", *extra,
    )


def first_window(cfg, data):
    """-> (trainer, its schedule, the training split, the first optimizer step, its micro-batches)."""
    from eyas.train.loop import Schedule, micro_batches

    train_idx, _ = build.splits(cfg, data)
    sched = Schedule(cfg.train, train_idx, data.lengths, cfg.seed, 0, 1)
    tr, _ = build.build_trainer(cfg, data, torch.device("cpu"), total_steps=sched.total)
    step, _, batches = next(micro_batches(tr, sched, data.source, 0, 0, 0))
    return tr, sched, train_idx, step, batches


def first_step(cfg, data):
    from eyas.train.loop import train_step

    tr, _, _, step, batches = first_window(cfg, data)
    out = train_step(tr, batches, step)
    return out, [b.sample_ids for b in batches], torch.cat([p.detach().flatten() for p in tr.draft.parameters()])
