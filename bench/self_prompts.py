"""User turns the target writes itself (`regenerate.self_prompts`), as MT-bench-form questions, so
that `bench/acc_by_position.py --bench` can score a draft on answers to them (CPU or GPU):

    python bench/self_prompts.py OUT.jsonl [--n 48] [--target embedded:smollm2] [--max-tokens 256]

Each kept prompt becomes {"question_id": "self-k", "category": "self", "turns": [prompt]}; the
counts (sampled, kept, unfinished, empty, duplicate) and the time go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas.config import load_config  # noqa: E402
from eyas.regenerate import HFBackend, sample_self_prompts  # noqa: E402
from eyas.target import load_tokenizer  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--target", default="embedded:smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    cfg = load_config(None, [f"--target.model={a.target}", f"--target.dtype={a.dtype}", f"--seed={a.seed}",
                             f"--regenerate.self_prompts={a.n}", f"--regenerate.self_prompt_max_tokens={a.max_tokens}",
                             f"--regenerate.batch_size={a.batch}"])
    tok = load_tokenizer(cfg.target)
    t0 = time.perf_counter()
    made = sample_self_prompts(HFBackend(cfg, tok), tok, cfg)
    print(f"[self_prompts] {made['counts']} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    with open(a.out, "w", encoding="utf-8") as f:
        for k, text in enumerate(made["prompts"]):
            f.write(json.dumps({"question_id": f"self-{k}", "category": "self", "turns": [text]}, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
