"""prepare: chat data -> token ids, assistant-only loss masks and the draft vocabulary.

    eyas prepare [recipe.yaml] [--prepare.data=chats.jsonl --target.model=/models/llama]

Each conversation is rendered with the **target tokenizer's own chat template**. The loss mask is
built without any per-family rule: the assistant contents are located in the rendered text (in
order, as the template wrote them), the text is tokenised once with character offsets, and a
token is masked in when its characters overlap an assistant content span; the first special token
that follows a span (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...) is masked in too, because the model
must learn to end its turn. Tests check the result independently by decoding the masked tokens.

Output directory (read it with `eyas.Prepared`):
    tokens.safetensors   input_ids int32 [N], loss_mask uint8 [N], offsets int64 [S+1]
    vocab.safetensors    d2t int64 [W], t2d bool [V], token_counts int64 [V]
    sample_ids.json      source conversation id of each sample
    meta.json, config.yaml
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from eyas import artifacts, vocab
from eyas.chat import Conversation, load_conversations
from eyas.config import EyasConfig, dump_config, to_dict
from eyas.errors import ConfigError, DataError
from eyas.target import describe_target, load_tokenizer, target_vocab_size, tokenizer_hash

DEFAULT_DRAFT_VOCAB = 32000


def special_ids(tok) -> set[int]:
    ids = set(tok.all_special_ids)
    for tid, added in tok.added_tokens_decoder.items():
        if added.special:
            ids.add(int(tid))
    return ids


def content_spans(text: str, conv: Conversation) -> list[tuple[int, int]]:
    """Character spans of each assistant content inside the rendered text, in order.

    Every message is located in turn (the cursor moves past user/system contents too), so an
    assistant answer that also occurs inside a later user message is not mistaken for it.
    """
    spans, cursor = [], 0
    for m in conv.messages:
        needle = m["content"]  # as rendered verbatim, else as templates that trim it render it
        start = text.find(needle, cursor)
        if start < 0:
            needle = needle.strip()
            start = text.find(needle, cursor)
        if start < 0 and m["role"] != "assistant":
            continue  # templates may rewrite system/user text; only assistant spans must be found
        if start < 0:
            raise DataError(
                f"conversation {conv.id}: the chat template does not reproduce an assistant message "
                f"verbatim (first 60 chars: {needle[:60]!r}); eyas cannot locate it to build the loss mask"
            )
        if m["role"] == "assistant":
            spans.append((start, start + len(needle)))
        cursor = start + len(needle)
    return spans


def mask_from_offsets(
    text: str, ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]], specials: set[int]
) -> list[int]:
    """1 for tokens overlapping an assistant span, and for the special token that ends the turn
    (the first special token after the span, with only whitespace in between)."""
    mask = [0] * len(ids)
    i = 0
    for start, end in spans:
        while i < len(ids) and offsets[i][1] <= start:
            i += 1
        while i < len(ids) and offsets[i][0] < end:
            if offsets[i][1] > offsets[i][0]:
                mask[i] = 1
            i += 1
        j = i
        while j < len(ids) and ids[j] not in specials and not text[offsets[j][0] : offsets[j][1]].strip():
            j += 1
        if j < len(ids) and ids[j] in specials:
            mask[j] = 1
    return mask


def render(tok, conv: Conversation) -> str:
    try:
        return tok.apply_chat_template(conv.messages, tokenize=False)
    except Exception as e:  # jinja raises many types; re-raised with the conversation named
        raise DataError(f"conversation {conv.id}: the chat template failed: {type(e).__name__}: {e}") from e


def tokenize_conversations(tok, convs: list[Conversation], max_length: int, batch_size: int, counts: Counter):
    """-> (ids per sample, mask per sample, kept conversation ids); drops are counted by reason."""
    specials = special_ids(tok)
    all_ids, all_masks, kept = [], [], []
    for b in range(0, len(convs), batch_size):
        batch = convs[b : b + batch_size]
        texts = [render(tok, c) for c in batch]
        enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        for conv, text, ids, offs in zip(batch, texts, enc["input_ids"], enc["offset_mapping"]):
            mask = mask_from_offsets(text, ids, offs, content_spans(text, conv), specials)
            if len(ids) > max_length:
                counts["truncated"] += 1
                counts["tokens_truncated_away"] += len(ids) - max_length
                ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask):
                counts["dropped_no_loss_tokens_after_truncation"] += 1
                continue
            all_ids.append(ids)
            all_masks.append(mask)
            kept.append(conv.id)
    return all_ids, all_masks, kept


_WORKER_TOKENIZER = None  # a prepare.num_workers process's own tokenizer (_start_worker)


def _start_worker(target) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism: no Rust threads per process
    _WORKER_TOKENIZER = load_tokenizer(target)


def _tokenize_chunk(job: tuple[list[Conversation], int, int]):
    convs, max_length, batch_size = job
    counts: Counter = Counter()
    return *tokenize_conversations(_WORKER_TOKENIZER, convs, max_length, batch_size, counts), counts


def tokenize_in_workers(cfg: EyasConfig, tok, convs: list[Conversation], counts: Counter):
    """tokenize_conversations over prepare.num_workers spawned processes (spawned, not forked: under
    `eyas run` this process may hold CUDA state from regenerate), the conversations cut into
    contiguous chunks in order, so the result is the one process's, sample for sample."""
    pc = cfg.prepare
    if pc.num_workers == 1 or len(convs) <= pc.batch_size:
        return tokenize_conversations(tok, convs, pc.max_length, pc.batch_size, counts)
    per = max(pc.batch_size, -(-len(convs) // (4 * pc.num_workers)))  # ~4 chunks per worker, for balance
    jobs = [(convs[i : i + per], pc.max_length, pc.batch_size) for i in range(0, len(convs), per)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(pc.num_workers, len(jobs)), initializer=_start_worker, initargs=(cfg.target,)) as pool:
        parts = pool.map(_tokenize_chunk, jobs)  # a worker's exception is raised here, its traceback chained
    ids, masks, kept = [], [], []
    for part_ids, part_masks, part_kept, part_counts in parts:
        ids += part_ids
        masks += part_masks
        kept += part_kept
        counts.update(part_counts)
    return ids, masks, kept


def main(cfg: EyasConfig) -> dict[str, Any]:
    pc = cfg.prepare
    out = cfg.stage_dir("prepare")
    t0 = time.perf_counter()
    tok = load_tokenizer(cfg.target)
    vsize = target_vocab_size(cfg.target)
    k = pc.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, vsize)
    if k > vsize:
        raise ConfigError(f"prepare.draft_vocab_size={k} is larger than the target vocabulary ({vsize}); use <= {vsize}")
    out.mkdir(parents=True, exist_ok=True)

    convs, counts = load_conversations(pc.data, pc.format, pc.max_conversations, pc.system_prompt)
    ids, masks, kept = tokenize_in_workers(cfg, tok, convs, counts)
    num_records = counts["records"]
    dropped = num_records - len(kept)
    if not kept or dropped / num_records > pc.max_drop_fraction:
        reasons = {r: n for r, n in counts.items() if r.startswith("dropped")}
        raise DataError(
            f"prepare dropped {dropped} of {num_records} conversations ({dropped / num_records:.1%}), more than "
            f"prepare.max_drop_fraction={pc.max_drop_fraction}; reasons: {reasons}"
        )

    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat_ids = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(offsets[-1]))
    flat_mask = np.fromiter((t for x in masks for t in x), dtype=np.uint8, count=int(offsets[-1]))
    tok_counts = vocab.token_counts(flat_ids.astype(np.int64), flat_mask, vsize)
    selected = vocab.select_draft_tokens(tok_counts, k)
    d2t, t2d = vocab.d2t_t2d(selected, vsize)
    cover = vocab.coverage(tok_counts, selected)

    save_file(
        {"input_ids": torch.from_numpy(flat_ids), "loss_mask": torch.from_numpy(flat_mask), "offsets": torch.from_numpy(offsets)},
        str(out / "tokens.safetensors"),
    )
    save_file({"d2t": d2t, "t2d": t2d, "token_counts": torch.from_numpy(tok_counts)}, str(out / "vocab.safetensors"))
    artifacts.atomic_write_json(out / "sample_ids.json", kept)
    artifacts.atomic_write_text(out / "config.yaml", dump_config(cfg))
    summary = {
        "records": num_records,
        "conversations_kept": len(kept),
        "conversations_dropped": dropped,
        "reasons": {r: n for r, n in sorted(counts.items()) if r != "records"},
        "tokens": int(offsets[-1]),
        "loss_tokens": int(flat_mask.sum()),
        "max_length": pc.max_length,
        "draft_vocab_size": k,
        "target_vocab_size": vsize,
        "draft_vocab_coverage": cover,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    artifacts.write_meta(
        out,
        "prepare",
        config={"target": to_dict(cfg.target), "prepare": to_dict(pc)},
        target=describe_target(cfg.target),
        hashes={"tokenizer": tokenizer_hash(tok), "data": data_hash(pc.data)},
        counts=summary,
    )
    print_summary(out, summary)
    return summary


def data_hash(path: str) -> str:
    from eyas import assets

    if path == "embedded:sharegpt":
        p = assets.sharegpt_path()
    else:
        p = Path(path)
    if p.is_dir():
        return artifacts.hash_json(sorted((str(f.relative_to(p)), f.stat().st_size) for f in p.rglob("*") if f.is_file()))
    return assets.sha256_file(p)


def print_summary(out: Path, s: dict[str, Any]) -> None:
    lines = [
        f"[eyas:prepare] wrote {out}",
        f"  conversations   {s['conversations_kept']:>10,} kept of {s['records']:,} records ({s['conversations_dropped']:,} dropped)",
    ]
    lines += [f"    {reason:<40} {n:>8,}" for reason, n in s["reasons"].items()]
    lines += [
        f"  tokens          {s['tokens']:>10,}",
        f"  loss tokens     {s['loss_tokens']:>10,} ({s['loss_tokens'] / max(s['tokens'], 1):.1%})",
        f"  draft vocab     {s['draft_vocab_size']:>10,} of {s['target_vocab_size']:,}; covers {s['draft_vocab_coverage']:.2%} of loss tokens",
        f"  time            {s['seconds']:>10.1f} s",
    ]
    print("\n".join(lines), flush=True)
