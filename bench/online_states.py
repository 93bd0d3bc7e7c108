"""Online training's target forward per packed batch (`OnlineStates`), its rows all padded to the
longest (one forward: the default) against grouped by length (`row_groups`), on a random-weight
target of the given config and batches packed as training packs them from real conversations (the
regenerated data/ files, tokenized with the target's chat template):

    python bench/online_states.py CONFIG_DIR DATA.jsonl.xz [DATA.jsonl.xz ...] [--out online_states.json]
    python bench/online_states.py $(python -c "from eyas.assets import smollm2_dir; print(smollm2_dir())") \\
        data/smollm2-*.jsonl.xz --out online_states.json      # SmolLM2-135M's config, the data/ files

Prints and writes, per group overhead and SDPA kernels allowed (`--backends`: eyas = OnlineStates'
default, ONLINE_SDPA; all (or default) = no restriction, PyTorch's own pick; or flash, efficient,
cudnn alone): milliseconds per batch, real tokens/s, forwards per batch and padded/real tokens,
for a first pass over the batches and a second over the same ones (shapes already seen: a kernel
that plans per shape is only slow on the first). The warm-up runs on batches outside the timed
ones; caches other than the kernels' (the allocator's) persist from one row to the next, so
for a clean first pass give one backend per run. Random weights: the
forward's cost does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import time

import torch
from torch.nn.attention import SDPBackend
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eyas.train.data import ONLINE_SDPA, OnlineStates, pack, pack_plan, row_groups


# --backends: the SDPA kernels OnlineStates may use (None: no restriction)
BACKENDS = {"eyas": list(ONLINE_SDPA), "all": None, "default": None, "flash": [SDPBackend.FLASH_ATTENTION],
            "efficient": [SDPBackend.EFFICIENT_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION]}


def sample_ids(tok, files: list[str], per_file: int, max_length: int, seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    out = []
    for f in files:
        with lzma.open(f, "rt", encoding="utf-8") as fh:
            recs = [json.loads(line) for line in fh]
        for r in rng.sample(recs, min(per_file, len(recs))):
            text = tok.apply_chat_template(r["messages"], tokenize=False)
            out.append(torch.tensor(tok(text, add_special_tokens=False).input_ids[:max_length]))
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config_dir", help="the target's config.json and tokenizer (no weights needed)")
    ap.add_argument("data", nargs="+", help="conversation files (.jsonl.xz, OpenAI messages)")
    ap.add_argument("--per-file", type=int, default=2000, help="conversations sampled from each file")
    ap.add_argument("--max-length", type=int, default=2048, help="tokens kept of each conversation")
    ap.add_argument("--max-tokens", type=int, default=16384, help="tokens per packed batch")
    ap.add_argument("--batches", type=int, default=40, help="timed batches")
    ap.add_argument("--overheads", default="none,2048", help="group_overhead_tokens to compare (none: one forward)")
    ap.add_argument("--backends", default="eyas,all", help="SDPA kernels to compare: " + ",".join(BACKENDS))
    ap.add_argument("--layers", default="2,15,27", help="the aux layers captured")
    ap.add_argument("--out", default="", help="also write the results to this JSON file")
    args = ap.parse_args()
    unknown = [b for b in args.backends.split(",") if b not in BACKENDS]
    if unknown:
        ap.error(f"--backends: unknown {unknown}; choose from {', '.join(BACKENDS)}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(args.config_dir)
    config = AutoConfig.from_pretrained(args.config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
    ids = sample_ids(tok, args.data, args.per_file, args.max_length, seed=0)
    lengths = [int(x.numel()) for x in ids]
    plans = pack_plan(list(range(len(ids))), lengths, args.max_tokens)[: args.batches + 3]
    smp = lambda i: dict(input_ids=ids[i], loss_mask=torch.ones_like(ids[i]), id=str(i), index=i)  # noqa: E731
    packed = [pack([smp(i) for i in plan], 7, args.max_tokens) for plan in plans]
    batches, warm_up = packed[: args.batches], packed[args.batches :]  # warm-up shapes outside the timed ones
    real = sum(sum(b.lengths) for b in batches)
    layer_ids = [int(x) for x in args.layers.split(",")]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for backend in args.backends.split(","):
        for o in args.overheads.split(","):
            overhead = None if o == "none" else int(o)
            states = OnlineStates(model, layer_ids, device, group_overhead_tokens=overhead,
                                  sdpa_backends=BACKENDS[backend])
            for b in warm_up:  # kernels, allocator
                states(b)
            for first_pass in (True, False):
                sync()
                n0, t0 = states.num_forwards, time.perf_counter()
                for b in batches:
                    states(b)
                sync()
                seconds = time.perf_counter() - t0
                groups = [[list(range(len(b.lengths)))] if overhead is None else row_groups(b.lengths, overhead)
                          for b in batches]
                padded = sum(len(g) * max(b.lengths[j] for j in g) for b, gs in zip(batches, groups) for g in gs)
                rows.append(dict(backend=backend, group_overhead_tokens=overhead, first_pass=first_pass,
                                 ms_per_batch=1e3 * seconds / len(batches), real_tokens_per_s=real / seconds,
                                 forwards_per_batch=(states.num_forwards - n0) / len(batches),
                                 padded_over_real=padded / real))
                print(json.dumps(rows[-1]), flush=True)
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                  batches=len(batches), samples_per_batch=sum(len(b.lengths) for b in batches) / len(batches),
                  real_tokens=real, max_tokens=args.max_tokens, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
