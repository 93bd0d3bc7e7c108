"""prepare: chat data -> token ids, assistant-only loss masks and the draft vocabulary.

    eyas prepare [recipe.yaml] [--prepare.data=chats.jsonl --target.model=/models/llama]

Each conversation is rendered with the **target tokenizer's own chat template**. The loss mask is
built without any per-family rule: the assistant contents are located in the rendered text (in
order, as the template wrote them), the text is tokenised once with character offsets (a slow
tokenizer's from its tokens' bytes: `byte_level_offsets`), and a token is masked in when its
characters overlap an assistant content span; the first special token that follows a span
(`<|im_end|>`, `<|eot_id|>`, `</s>`, ...) is masked in too, because the model must learn to end
its turn. Tests check the result independently by decoding the masked tokens.

Reasoning. An assistant message's `reasoning_content` (eyas.chat) is passed to the template, which
decides where it shows: Qwen3's template renders it for the turns after the last user query only,
Kimi-K2's only after the last assistant turn without tool calls. Which turns it rendered is found by
rendering once with a marker in place of each reasoning (`rendered_reasoning`); a rendered
reasoning must then be found verbatim (or stripped), after the previous message and before its own
content, else the conversation fails by id, as for contents. For such a turn the masked span is
everything the model writes when served: from the end of the template's generation prompt (the
text `add_generation_prompt` appends, e.g. `<|im_start|>assistant\n`) through the reasoning, the
template's text between reasoning and content, and the content, then the end-of-turn token. So
`<think>\n` ... `\n</think>\n\n` (Qwen3) or `<think>` ... `</think>` (Kimi-K2-Thinking) are
masked in, the draft learns to predict `</think>`, and a template whose generation prompt already
ends with `<think>` (Kimi-K2.5, Qwen3-Thinking-2507) keeps that opener unmasked, as the model never
writes it. A turn without rendered reasoning masks its content only: the empty `<think>\n\n</think>`
Qwen3's template inserts is template text, not the model's. Reasoning the template drops on earlier
turns is counted (`reasoning_not_rendered`). A template that drops the last assistant turn's
reasoning but renders an empty thinking block there (Kimi-K2-Thinking's and K2.5's, which show
reasoning only after the last plain assistant turn: `<think></think>answer`) gets the reasoning
written into that block, as the model writes it when served (`fill_thinking`); one that renders
neither is an error naming the conversation: pass a template that renders it
(`--target.chat_template`) or `--prepare.reasoning=drop` to train on the answers alone.

Output directory (read it with `eyas.Prepared`):
    tokens.safetensors   input_ids int32 [N], loss_mask uint8 [N], offsets int64 [S+1]
    vocab.safetensors    d2t int64 [W], t2d bool [V], token_counts int64 [V]
    sample_ids.json      source conversation id of each sample
    meta.json, config.yaml
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas import artifacts, vocab
from eyas.chat import REASONING, Conversation, load_conversations
from eyas.config import EyasConfig, dump_config, to_dict
from eyas.errors import ConfigError, DataError, EyasError, describe_exception
from eyas.target import describe_target, load_tokenizer, target_vocab_size, tokenizer_hash

DEFAULT_DRAFT_VOCAB = 32000


def special_ids(tok) -> set[int]:
    ids = set(tok.all_special_ids)
    for tid, added in tok.added_tokens_decoder.items():
        if added.special:
            ids.add(int(tid))
    return ids


_MARK = "\u2063eyas reasoning {}\u2063"  # invisible separators: no template writes them


def rendered_reasoning(tok, conv: Conversation) -> tuple[set[int], int | None]:
    """Indices of the messages whose reasoning the chat template renders, found by rendering the
    conversation once with a unique marker in place of each reasoning; and the last assistant turn's
    index when the template drops that turn's reasoning (eyas then writes it in: `fill_thinking`)."""
    if not any(REASONING in m for m in conv.messages):
        return set(), None
    probe = [dict(m, **{REASONING: _MARK.format(i)}) if REASONING in m else m for i, m in enumerate(conv.messages)]
    text = render(tok, Conversation(conv.id, probe))
    shown = {i for i, m in enumerate(conv.messages) if REASONING in m and _MARK.format(i) in text}
    last = max(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
    return shown, (last if REASONING in conv.messages[last] and last not in shown else None)


THINK_END = "</think>"


def fill_thinking(tok, conv: Conversation, text: str, i: int) -> str:
    """`text` with the reasoning of assistant turn i (the last) written into the empty thinking block
    the template renders for it. Templates such as Kimi-K2-Thinking's and K2.5's show reasoning only
    after the last plain assistant turn, so a conversation that ends on one renders its last turn
    as `<think></think>answer`; served, the model writes `<think>reasoning</think>answer` there (the
    earlier turns stay as the template renders history). The reasoning goes right before the first
    `</think>` between the end of the generation prompt and the answer; a template that renders
    no such block is an error naming the conversation."""
    m = conv.messages[i]
    gen_prompt = generation_prompt(tok, conv, i)
    content_at = text.rfind(m["content"].strip())
    head = text.rfind(gen_prompt, 0, content_at) if gen_prompt and content_at >= 0 else -1
    close = text.find(THINK_END, head + len(gen_prompt), content_at) if head >= 0 else -1
    if close < 0:
        raise DataError(
            f"conversation {conv.id}: the chat template does not render the reasoning (reasoning_content) of the "
            f"last assistant turn, nor an empty thinking block ending in {THINK_END} for eyas to write it into, so the "
            "draft would not learn the thinking the target writes when served; use a template that renders it "
            "(--target.chat_template=FILE) or --prepare.reasoning=drop to train on the answers alone"
        )
    return text[:close] + m[REASONING] + text[close:]


def generation_prompt(tok, conv: Conversation, i: int) -> str | None:
    """The text the template's generation prompt appends after messages[:i] (`<|im_start|>assistant\n`):
    where what the model writes for message i begins. None when the prompted rendering does not
    extend the plain one."""
    head = Conversation(conv.id, conv.messages[:i])
    bare, prompted = render(tok, head), render(tok, head, add_generation_prompt=True)
    return prompted[len(bare):] if prompted.startswith(bare) and len(prompted) > len(bare) else None


def _find(text: str, needle: str, cursor: int) -> tuple[int, str]:
    """Where `needle` is rendered from `cursor` on: verbatim, else as templates that trim it render it."""
    start = text.find(needle, cursor)
    if start < 0:
        needle = needle.strip()
        start = text.find(needle, cursor)
    return start, needle


def content_spans(text: str, conv: Conversation, shown: set[int] = frozenset(), tok=None) -> list[tuple[int, int]]:
    """Character spans of each assistant turn inside the rendered text, in order: its content, or,
    when its reasoning is rendered (`shown`), from the end of the generation prompt before the
    reasoning (else the reasoning itself) through the content.

    Every message is located in turn (the cursor moves past user/system contents too), so an
    assistant answer that also occurs inside a later user message is not mistaken for it.
    """
    spans, cursor = [], 0
    for i, m in enumerate(conv.messages):
        first = -1
        if i in shown:
            at, needle = _find(text, m[REASONING], cursor)
            if at < 0:
                raise DataError(
                    f"conversation {conv.id}: the chat template does not reproduce an assistant reasoning verbatim "
                    f"(first 60 chars: {needle[:60]!r}); eyas cannot locate it to build the loss mask"
                )
            gen_prompt = generation_prompt(tok, conv, i)
            head = text.rfind(gen_prompt, cursor, at) if gen_prompt else -1
            first = head + len(gen_prompt) if head >= 0 else at
            cursor = at + len(needle)
        start, needle = _find(text, m["content"], cursor)
        if start < 0 and m["role"] != "assistant":
            continue  # templates may rewrite system/user text; only assistant spans must be found
        if start < 0:
            raise DataError(
                f"conversation {conv.id}: the chat template does not reproduce an assistant message "
                f"verbatim (first 60 chars: {needle[:60]!r}); eyas cannot locate it to build the loss mask"
            )
        if m["role"] == "assistant":
            spans.append((first if first >= 0 else start, start + len(needle)))
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


def drop_reasoning(convs: list[Conversation]) -> int:
    """Remove every message's reasoning (prepare.reasoning=drop); returns how many there were."""
    n = 0
    for c in convs:
        for m in c.messages:
            n += m.pop(REASONING, None) is not None
    return n


def render(tok, conv: Conversation, add_generation_prompt: bool = False) -> str:
    try:
        return tok.apply_chat_template(conv.messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises many types; re-raised with the conversation named
        raise DataError(f"conversation {conv.id}: the chat template failed: {type(e).__name__}: {e}") from e


def token_bytes(tok, ids) -> dict[int, bytes | None]:
    """The bytes each id of a byte-level BPE tokenizer stands for: an added token's own text, else the
    token's GPT-2 byte-to-unicode spelling (what convert_ids_to_tokens gives for byte-level BPEs,
    tiktoken ones included) mapped back to bytes; None for a token not spelt that way."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = {int(i): t.content for i, t in tok.added_tokens_decoder.items()}
    table = {}
    for tid in set(ids):
        if tid in added:
            table[tid] = added[tid].encode()
            continue
        piece = tok.convert_ids_to_tokens(tid)
        table[tid] = bytes(byte_of[c] for c in piece) if piece and all(c in byte_of for c in piece) else None
    return table


def byte_level_offsets(tok, texts: list[str], ids_per_text: list[list[int]], convs: list[Conversation]):
    """Token -> character offsets for a slow (Python) tokenizer, which gives none: each token's bytes,
    laid end to end, must spell the text's UTF-8 bytes exactly (checked; else a ConfigError naming the
    tokenizer and the conversation: never a silently wrong mask); a token's characters are those its
    bytes fall in, so a token holding part of a character's bytes overlaps that whole character."""
    table = token_bytes(tok, [t for ids in ids_per_text for t in ids])
    out = []
    for text, ids, conv in zip(texts, ids_per_text, convs):
        data = text.encode("utf-8")
        pieces = [table[t] for t in ids]
        if None in pieces or b"".join(pieces) != data:
            raise ConfigError(_spelling_mismatch(tok, data, ids, pieces, conv.id))
        num_bytes = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))  # per token
        byte_end = np.cumsum(num_bytes)
        # character index of every byte (a UTF-8 continuation byte is 10xxxxxx), + one past the end
        char_of_byte = np.cumsum((np.frombuffer(data, dtype=np.uint8) & 0xC0) != 0x80) - 1
        char_of_byte = np.append(char_of_byte, len(text))
        char_start = char_of_byte[byte_end - num_bytes]
        char_end = np.where(num_bytes > 0, char_of_byte[np.maximum(byte_end - 1, 0)] + 1, char_start)
        out.append(list(zip(char_start.tolist(), char_end.tolist())))
    return out


def _spelling_mismatch(tok, data: bytes, ids: list[int], pieces: list, conv_id) -> str:
    at = 0
    for k, (tid, piece) in enumerate(zip(ids, pieces)):
        if piece is None or data[at : at + len(piece)] != piece:
            what = (f"token {k} (id {tid}, {tok.convert_ids_to_tokens(tid)!r}) is not byte-level BPE" if piece is None
                    else f"token {k} (id {tid}) is {piece!r} where the text has {data[at : at + len(piece)]!r}")
            break
        at += len(piece)
    else:
        what = f"the tokens spell {at} of the text's {len(data)} bytes"
    return (f"the tokenizer of target {tok.name_or_path!r} ({type(tok).__name__}) is a slow tokenizer, and its tokens "
            f"do not spell the rendered text of conversation {conv_id} byte for byte ({what}): eyas builds the loss "
            "masks of slow tokenizers from their tokens' bytes, which needs a byte-level BPE (GPT-2 or tiktoken "
            "style); give target.model a fast tokenizer (tokenizer.json)")


def tokenize_conversations(tok, convs: list[Conversation], max_length: int, batch_size: int, counts: Counter):
    """-> (ids per sample, mask per sample, kept conversation ids); drops are counted by reason."""
    specials = special_ids(tok)
    all_ids, all_masks, kept = [], [], []
    for b in range(0, len(convs), batch_size):
        batch = convs[b : b + batch_size]
        texts, shown_per_conv = [], []
        for conv in batch:
            text = render(tok, conv)
            shown, fill = rendered_reasoning(tok, conv)
            if fill is not None:
                text = fill_thinking(tok, conv, text, fill)
                shown.add(fill)
                counts["reasoning_written_into_empty_block"] += 1
            counts["reasoning_not_rendered"] += sum(REASONING in m for m in conv.messages) - len(shown)
            texts.append(text)
            shown_per_conv.append(shown)
        enc = tok(texts, add_special_tokens=False, return_offsets_mapping=tok.is_fast)
        offsets = enc["offset_mapping"] if tok.is_fast else byte_level_offsets(tok, texts, enc["input_ids"], batch)
        for conv, text, ids, offs, shown in zip(batch, texts, enc["input_ids"], offsets, shown_per_conv):
            mask = mask_from_offsets(text, ids, offs, content_spans(text, conv, shown, tok), specials)
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


def _serve(conn, target) -> None:
    """A prepare.num_workers process: load the tokenizer, send "ready", then answer each chunk it is
    sent until None. A failure is sent as its description (type, message, traceback: a pickled
    exception loses its traceback) and, when it pickles, the exception itself."""
    try:
        _start_worker(target)
        conn.send(("ready", None))
        while (job := conn.recv()) is not None:
            conn.send(("done", _tokenize_chunk(job)))
    except Exception as e:  # sent to the parent, which raises it
        try:
            blob = pickle.dumps(e)
        except Exception:  # an exception that does not pickle: the parent raises its description
            blob = None
        conn.send(("failed", (describe_exception(e), blob)))


@dataclass
class _Worker:
    """A prepare.num_workers process, the parent's end of its pipe, and what it does."""

    number: int  # 1-based, for messages
    process: Any  # multiprocessing.Process
    conn: Any  # multiprocessing.connection.Connection
    ready: bool = False  # its tokenizer is loaded
    chunk: int | None = None  # the index of the chunk it tokenizes, None when idle or starting


class WorkerTraceback(Exception):
    """A prepare worker's traceback, as text: the cause chained to its exception re-raised here."""


def _run_workers(num_workers: int, target, jobs: list) -> list:
    """_tokenize_chunk of each job on `num_workers` spawned processes -> the results in job order.

    Each worker is started once and has a pipe of its own, so the parent knows which chunk every
    worker holds and sees a death at once (the pipe closes, the process sentinel fires). A worker
    that is killed (the OOM killer's SIGKILL) or fails to start ends prepare with an EyasError naming
    it, its exit status and its chunk (multiprocessing.Pool respawned it and waited forever for the
    chunk); one whose chunk raises ends it with that exception (_raise_failure)."""
    ctx = multiprocessing.get_context("spawn")  # not fork: under `eyas run` this process may hold CUDA state
    workers: list[_Worker] = []
    try:
        for number in range(1, num_workers + 1):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(theirs, target), name=f"eyas-prepare-{number}", daemon=True)
            process.start()
            theirs.close()  # the worker holds the only other end: its death closes the pipe
            workers.append(_Worker(number, process, ours))
        results, todo, num_done = [None] * len(jobs), iter(range(len(jobs))), 0
        while num_done < len(jobs):
            waiting = [w for w in workers if not w.ready or w.chunk is not None]
            ready = connection.wait([w.conn for w in waiting] + [w.process.sentinel for w in waiting])
            for w in waiting:
                if w.conn not in ready and w.process.sentinel not in ready:
                    continue
                kind, payload = _receive(w, workers, jobs)
                if kind == "failed":
                    _raise_failure(w, workers, jobs, *payload)
                if kind == "done":
                    results[w.chunk] = payload
                    num_done += 1
                w.ready, w.chunk = True, next(todo, None)
                if w.chunk is not None:
                    w.conn.send(jobs[w.chunk])
        return results
    finally:  # done or failed: stop every worker (idle ones wait for a chunk that will not come)
        for w in workers:
            w.process.terminate()
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()


def _receive(w: _Worker, workers: list[_Worker], jobs: list) -> tuple[str, Any]:
    """The worker's next message; an EyasError naming it, its exit status and its chunk if it died."""
    try:
        if w.conn.poll():  # a message sent before dying is still read
            return w.conn.recv()
    except (EOFError, OSError):  # the pipe closed: the worker is gone
        pass
    w.process.join(timeout=10)
    code = w.process.exitcode
    if code is not None and code < 0:
        try:
            status = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            status = f"was killed by signal {-code}"
    else:
        status = f"exited with code {code}" if code is not None else "closed its pipe"
    doing = "while starting (loading the target tokenizer)" if w.chunk is None else f"while tokenizing {_chunk_text(w.chunk, jobs)}"
    if code == -signal.SIGKILL:
        fix = ("SIGKILL is what the kernel's out-of-memory killer sends (`dmesg` says whether it did): each worker "
               f"holds a tokenizer and a chunk of conversations, so use fewer --prepare.num_workers (now {len(workers)}), "
               "or free memory")
    else:
        fix = "its output above says why; --prepare.num_workers=1 runs the same work in this process"
    raise EyasError(f"prepare worker {w.number} of {len(workers)} (pid {w.process.pid}) {status} {doing}; {fix}")


def _raise_failure(w: _Worker, workers: list[_Worker], jobs: list, desc: dict[str, str], blob: bytes | None):
    """Raise what the worker sent: a start-up failure as an EyasError showing the worker's exception
    in full; a chunk's exception as itself (its message names the conversation), chained from the
    worker's traceback and noted with the chunk."""
    where = f"prepare worker {w.number} of {len(workers)} (pid {w.process.pid})"
    if w.chunk is None:
        raise EyasError(
            f"{where} could not start: loading the target tokenizer failed there (fix the error below; "
            "--prepare.num_workers=1 tokenizes in this process, where the tokenizer loaded):\n"
            f"{desc['type']}: {desc['message']}\n{desc['traceback']}"
        )
    try:
        exc = pickle.loads(blob) if blob is not None else None
    except Exception:  # one that does not unpickle (a required argument): raised as its description below
        exc = None
    if exc is None:
        raise EyasError(f"{where} failed while tokenizing {_chunk_text(w.chunk, jobs)}:\n"
                        f"{desc['type']}: {desc['message']}\n{desc['traceback']}")
    exc.add_note(f"in {where}, tokenizing {_chunk_text(w.chunk, jobs)}")
    raise exc from WorkerTraceback(desc["traceback"])


def _chunk_text(j: int, jobs: list) -> str:
    convs = jobs[j][0]
    return f"chunk {j + 1} of {len(jobs)} (conversations {convs[0].id} .. {convs[-1].id}, {len(convs)} in all)"


def tokenize_in_workers(cfg: EyasConfig, tok, convs: list[Conversation], counts: Counter):
    """tokenize_conversations over prepare.num_workers spawned processes (_run_workers), the
    conversations cut into contiguous chunks in order, so the result is the one process's, sample
    for sample."""
    pc = cfg.prepare
    if pc.num_workers == 1 or len(convs) <= pc.batch_size:
        return tokenize_conversations(tok, convs, pc.max_length, pc.batch_size, counts)
    per = max(pc.batch_size, -(-len(convs) // (4 * pc.num_workers)))  # ~4 chunks per worker, for balance
    jobs = [(convs[i : i + per], pc.max_length, pc.batch_size) for i in range(0, len(convs), per)]
    parts = _run_workers(min(pc.num_workers, len(jobs)), cfg.target, jobs)
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

    convs, counts = load_conversations(pc.data, pc.format, pc.max_conversations, pc.system_prompt,
                                       pc.skip_bad_records)
    if pc.reasoning == "drop":
        counts["reasoning_dropped"] += drop_reasoning(convs)
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

    artifacts.atomic_save_safetensors(
        {"input_ids": torch.from_numpy(flat_ids), "loss_mask": torch.from_numpy(flat_mask), "offsets": torch.from_numpy(offsets)},
        out / "tokens.safetensors",
    )
    artifacts.atomic_save_safetensors({"d2t": d2t, "t2d": t2d, "token_counts": torch.from_numpy(tok_counts)},
                                      out / "vocab.safetensors")
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
        files=artifacts.file_record(out, list(OUTPUT_FILES)),
    )
    print_summary(out, summary)
    return summary


OUTPUT_FILES = ("tokens.safetensors", "vocab.safetensors", "sample_ids.json")
"""What prepare writes that later stages read; meta.json records their sha256 (eyas.prepared checks it)."""


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
