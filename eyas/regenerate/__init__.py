"""regenerate: the target rewrites every assistant turn, turn by turn, given the conversation so far.

    eyas regenerate recipe.yaml                               # in-process HF generate (default)
    eyas regenerate --backend server --server_url http://127.0.0.1:8000   # vllm serve / SGLang

Answers written by the target itself are the largest single lever on draft acceptance (EAGLE-3
paper and every public reproduction): the draft learns the distribution it will have to predict.

For a conversation [system?, u1, a1, u2, a2, ...] the output is [system?, u1, a1', u2, a2', ...]
where a1' is generated from [system?, u1] and a2' from [system?, u1, a1', u2]. An answer's thinking
block is kept as its message's `reasoning_content` (the server's `reasoning_content`/`reasoning`
field, or the `<think>...</think>` the target wrote) and is part of a1' in the later prompts, where
the chat template decides whether to show it (Qwen3's drops it). Conversations are
processed in chunks (`chunk_conversations`); round r of a chunk generates turn r of every
conversation in it as one batch. A chunk is appended to `conversations.jsonl` (OpenAI form, one
record per line, fsync'd) only when all its turns are done, so re-running the same command skips
every completed conversation and redoes at most one chunk. A turn whose prompt exceeds
`max_prompt_tokens` ends its conversation there (counted).

`self_prompts` adds conversations the target starts itself (eyas.regenerate.self_prompts), answered
in the same chunks after the data's conversations.

Modules: backends (the target in this process, or an OpenAI-compatible server), self_prompts.
Nothing is skipped silently: a failed request ends the run naming the conversation.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from eyas import artifacts
from eyas.chat import REASONING, Conversation, load_conversations
from eyas.config import EyasConfig, dump_config, to_dict
from eyas.errors import ConfigError, EyasError, raise_if_terminated
from eyas.regenerate.backends import REFUSED, HFBackend, ServerBackend
from eyas.regenerate.self_prompts import SELF_PROMPTS, read_self_prompts, self_conversations
from eyas.target import describe_target, load_tokenizer


OUTPUT = "conversations.jsonl"
INPUTS = "inputs.json"
"""What the answers in OUTPUT are made from (`answer_inputs`), written before the first is appended."""
HOW_IT_RUNS = ("enabled", "out_dir", "chunk_conversations", "server_url")
"""regenerate keys that do not shape an answer (besides eyas.run.plan.BUDGET_KEYS' time and retry budgets):
a server that moved to another address answers as before (server_model names what answers)."""
OTHER_BACKENDS = {"server": ("device", "batch_size", "static_widths", "static_cache"),
                  "hf": ("server_model", "extra_body"), "vllm": ("server_model", "extra_body")}
"""Keys of the other backends, which the one in use ignores."""


def regenerate_chunk(backend, tok, convs: list[Conversation], rc, counts: Counter,
                     refused: list[str] | None = None) -> list[dict[str, Any]]:
    """All turns of `convs`, round by round (turn r of every conversation in one batch). A refused
    answer (the server backend's checks) ends its conversation before that turn, said at once and
    listed in `refused`."""
    states = []
    for c in convs:
        head = [m for m in c.messages[:1] if m["role"] == "system"]
        users = [m["content"] for m in c.messages if m["role"] == "user"]
        states.append({"conv": c, "index": c.index, "messages": list(head), "users": users, "reasons": [], "open": True})
    rounds = max(len(s["users"]) for s in states)
    for r in range(min(rounds, rc.max_turns) if rc.max_turns else rounds):
        live = [s for s in states if s["open"] and r < len(s["users"])]
        prompts, prompt_ids = [], []
        for s in list(live):
            msgs = s["messages"] + [{"role": "user", "content": s["users"][r]}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
            if len(ids) > rc.max_prompt_tokens:
                s["open"] = False
                counts["conversations_cut_at_prompt_limit"] += 1
                live.remove(s)
                continue
            prompts.append(msgs)
            prompt_ids.append(list(ids))
        if not live:
            continue
        if isinstance(backend, ServerBackend):
            answers = backend.generate_messages(prompts, [s["conv"].id for s in live])
        else:
            answers = backend.generate(prompt_ids)
        for s, msgs, a in zip(live, prompts, answers):
            counts["answers_asked"] += 1
            if a.refused:
                s["open"] = False
                counts["answers_refused"] += 1
                counts[f"answers_refused_{a.refused}"] += 1
                said = f"conversation {s['conv'].id}, turn {r + 1}: refused: {REFUSED[a.refused]}"
                said += f": {a.why}" if a.why else ""
                print(f"[eyas:regenerate] {said}; the conversation ends before it", file=sys.stderr, flush=True)
                if refused is not None:
                    refused.append(said)
                continue
            counts["new_tokens"] += a.new_tokens
            if not a.text and a.reasoning:  # cut at max_new_tokens while thinking: no answer to train on
                s["open"] = False
                counts["conversations_cut_while_thinking"] += 1
                continue
            s["messages"] = msgs + [{"role": "assistant", "content": a.text, **({REASONING: a.reasoning} if a.reasoning else {})}]
            s["reasons"].append(a.finish_reason)
            counts["turns"] += 1
            counts[f"finish_{a.finish_reason}"] += 1
            if not a.text:
                counts["empty_answers"] += 1
            if a.reasoning:
                counts["answers_with_reasoning"] += 1
    out = []
    for s in states:
        if not any(m["role"] == "assistant" for m in s["messages"]):
            counts["dropped_no_answer"] += 1  # its first prompt too long, or its first answer cut while thinking
            continue
        out.append({"id": s["conv"].id, "source_index": s["index"], "messages": s["messages"], "finish_reasons": s["reasons"]})
    return out


def check_refused(counts: Counter, rc, refused: list[str]) -> None:
    """EyasError when more answers were refused so far than regenerate.max_refused_fraction allows
    (checked before a chunk is written: nothing of it is kept)."""
    if counts["answers_refused"] <= rc.max_refused_fraction * counts["answers_asked"]:
        return
    shown = "; ".join(refused[:5]) + (f"; ... ({len(refused) - 5} more)" if len(refused) > 5 else "")
    raise EyasError(f"regenerate: {counts['answers_refused']} of {counts['answers_asked']} answers refused "
                    f"({refused_counts(counts)}), more than regenerate.max_refused_fraction={rc.max_refused_fraction:g} "
                    f"allows: {shown}. This chunk was not written. Fix the server and run the same command again "
                    "(written conversations are kept), or raise regenerate.max_refused_fraction to go on without them")


def refused_counts(counts: Counter) -> str:
    """e.g. '3 empty, 1 over max_tokens'."""
    names = {"empty": "empty", "over_max_tokens": "over max_tokens", "not_utf8": "not UTF-8"}
    return ", ".join(f"{counts[f'answers_refused_{k}']} {v}" for k, v in names.items() if counts[f"answers_refused_{k}"])


def out_of_time(elapsed: float, per_batch: float, conversations: int, rc) -> bool:
    """Whether the next chunk, of this many conversations, would overrun regenerate.max_seconds:
    planned as the slowest chunk's seconds per batch so far times the batches it fills."""
    return bool(rc.max_seconds) and elapsed + per_batch * batches(conversations, rc.batch_size) > rc.max_seconds


def batches(conversations: int, batch_size: int) -> int:
    """Batches of rows a chunk of this many conversations fills in its first round: what the
    max_seconds check scales the slowest chunk's time per batch by, so a short last chunk is
    planned at its own cost (a chunk's later rounds shrink alike)."""
    return -(-conversations // batch_size)


def read_done(path: Path) -> set[int]:
    """Source indices already written. A torn last line (killed mid-write) is cut off."""
    if not path.is_file():
        return set()
    raw = path.read_bytes()
    good = raw[: raw.rfind(b"\n") + 1]
    if len(good) != len(raw):
        with artifacts.open_no_follow(path, "r+b", "point --regenerate.out_dir elsewhere") as f:
            f.truncate(len(good))
    done = set()
    # split on "\n" only: str.splitlines() also breaks at U+2028, U+0085, ... which json.dumps
    # leaves unescaped (ensure_ascii=False) inside generated text
    for lineno, line in enumerate(good.decode().split("\n")[:-1], 1):
        try:
            done.add(int(json.loads(line)["source_index"]))
        except (json.JSONDecodeError, KeyError, ValueError) as e:
            raise EyasError(f"{path}:{lineno}: unreadable record ({type(e).__name__}); delete the file to start over") from None
    return done


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    with artifacts.open_no_follow(path, "a", "point --regenerate.out_dir elsewhere") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def answer_inputs(cfg: EyasConfig) -> dict[str, Any]:
    """What an answer depends on: the target, the regenerate settings (but its budgets and
    HOW_IT_RUNS), the data's format and system prompt, and the data by content (sha256), so the same
    file under another path continues its answers. prepare.max_conversations is left out: it says
    how many of the data's conversations to answer, and a larger one continues the file."""
    from eyas.prepare import data_hash
    from eyas.run.plan import BUDGET_KEYS

    skip = set(BUDGET_KEYS["regenerate"]) | set(HOW_IT_RUNS) | set(OTHER_BACKENDS.get(cfg.regenerate.backend, ()))
    settings = {f"target.{k}": v for k, v in to_dict(cfg.target).items()}
    settings.update({f"regenerate.{k}": v for k, v in to_dict(cfg.regenerate).items() if k not in skip})
    settings.update({f"prepare.{k}": getattr(cfg.prepare, k) for k in ("format", "system_prompt")})
    return {"data": {"path": cfg.prepare.data, "sha256": data_hash(cfg.prepare.data)}, "settings": settings}


def changed_inputs(was: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key: old -> new` for each input that differs (a setting an earlier eyas did not record is not compared)."""
    out = []
    if was["data"]["sha256"] != now["data"]["sha256"]:
        out.append(f"prepare.data: {was['data']['path']} (sha256 {was['data']['sha256'][:12]}) -> {now['data']['path']} "
                   f"(sha256 {now['data']['sha256'][:12]})")
    out += [f"{k}: {was['settings'][k]!r} -> {v!r}" for k, v in now["settings"].items()
            if k in was["settings"] and was["settings"][k] != v]
    return out


def check_inputs(out: Path, now: dict[str, Any], done: set[int]) -> None:
    """Continue the answers in out/OUTPUT only under the inputs they were made from (out/INPUTS);
    with none written yet, record `now` as theirs. Checked before anything is loaded or changed."""
    path = out / INPUTS
    if not done:
        artifacts.atomic_write_text(path, json.dumps(now, indent=1))
        return
    fix = f"write elsewhere with --regenerate.out_dir, or delete {out / OUTPUT} to answer again"
    try:
        was = json.loads(path.read_text())
        was["data"]["sha256"], was["settings"].items()
    except FileNotFoundError:  # answers of an earlier eyas, which kept no record: continued, said so (as train does)
        print(f"[eyas:regenerate] {out / OUTPUT}: {len(done)} conversations answered by an earlier eyas, which recorded "
              f"no inputs: continued, and this run's inputs recorded as theirs in {path} (not checked)", flush=True)
        artifacts.atomic_write_text(path, json.dumps(now, indent=1))
        return
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path} is not a regenerate inputs record ({type(e).__name__}: {e}): {fix}") from e
    changed = changed_inputs(was, now)
    if changed:
        raise ConfigError(f"{out / OUTPUT} holds {len(done)} conversations answered under other inputs, which this run "
                          f"would mix with its own answers: {'; '.join(changed)}. To continue it, go back to those "
                          f"settings; or write elsewhere with --regenerate.out_dir, or delete {out / OUTPUT} to answer again")


def main(cfg: EyasConfig) -> dict[str, Any]:
    from tqdm import tqdm

    rc, pc = cfg.regenerate, cfg.prepare
    out = cfg.stage_dir("regenerate")
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(cfg.target)
    convs, load_counts = load_conversations(pc.data, pc.format, pc.max_conversations, pc.system_prompt,
                                            pc.skip_bad_records)
    path = out / OUTPUT
    done = read_done(path)
    made = read_self_prompts(out / SELF_PROMPTS, path, cfg, done) if rc.self_prompts else None
    inputs = answer_inputs(cfg)
    check_inputs(out, inputs, done)
    # checked what is cheap: from here the output is incomplete until this run finishes
    (out / "meta.json").unlink(missing_ok=True)
    artifacts.atomic_write_text(out / "config.yaml", dump_config(cfg))
    if rc.backend == "vllm":
        from eyas.regenerate.vllm_backend import VLLMBackend

        backend = VLLMBackend(cfg, tok)
    else:
        backend = ServerBackend(cfg) if rc.backend == "server" else HFBackend(cfg, tok)
    t0 = time.perf_counter()  # the budget counts sampling self-written user turns too
    own: list[Conversation] = []
    self_counts: dict[str, Any] = {}
    if rc.self_prompts:  # after the data's conversations, in the same chunks
        own, self_counts = self_conversations(out / SELF_PROMPTS, made, backend, tok, cfg)
    todo = [c for c in convs + own if c.index not in done]
    if done:
        print(f"[eyas:regenerate] resuming: {len(done)} conversations already done, {len(todo)} to go", flush=True)
    counts: Counter = Counter()
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv", dynamic_ncols=True)
    per_batch, skipped = 0.0, 0
    refused: list[str] = []
    for b in range(0, len(todo), rc.chunk_conversations):
        raise_if_terminated()
        ahead = len(todo[b : b + rc.chunk_conversations])
        if b and out_of_time(time.perf_counter() - t0, per_batch, ahead, rc):  # a run always makes progress
            skipped = len(todo) - b
            print(f"\n[eyas:regenerate] regenerate.max_seconds={rc.max_seconds:g} reached: {skipped} conversations "
                  "left for a later run", flush=True)
            break
        chunk = todo[b : b + rc.chunk_conversations]
        t_chunk = time.perf_counter()
        before = counts["new_tokens"]
        try:
            records = regenerate_chunk(backend, tok, chunk, rc, counts, refused)
            check_refused(counts, rc, refused)
        except BaseException:
            if rc.backend == "vllm":  # the engine's GPUs free again, whoever catches this
                backend.close(failed=True)
            raise
        append_records(path, records)
        dt = time.perf_counter() - t_chunk
        per_batch = max(per_batch, dt / batches(len(chunk), rc.batch_size))
        tqdm.write(f"[eyas:regenerate] chunk of {len(chunk)} conversations: {counts['new_tokens'] - before:,} new tokens "
                   f"in {dt:.1f} s ({(counts['new_tokens'] - before) / max(dt, 1e-9):,.0f} tok/s)")
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{counts['new_tokens'] / max(time.perf_counter() - t0, 1e-9):,.0f}")
    bar.close()
    seconds = time.perf_counter() - t0
    if rc.backend == "vllm":
        backend.close()  # parked for extract under `eyas run` with extract.backend=vllm, else shut down
    total = len(read_done(path))
    summary = {
        "conversations_in": len(convs),
        "self_written": len(own),
        "conversations_written": total,
        "regenerated_now": len(todo) - skipped,
        "not_started": skipped,
        "stopped_early": skipped > 0,
        "resumed_from": len(done),
        "turns": counts["turns"],
        "new_tokens": counts["new_tokens"],
        "tokens_per_s": counts["new_tokens"] / seconds if seconds > 0 else 0.0,
        "seconds": round(seconds, 2),
        "counts": dict(counts),
        "load_counts": dict(load_counts),
        "self_prompts": self_counts,
        "server_retries": getattr(backend, "retried", 0),
        "server_stalls": getattr(backend, "stalls", 0),
        "server_wait_s": round(getattr(backend, "waited_s", 0.0), 2),
        "answers_refused": counts["answers_refused"],
    }
    artifacts.write_meta(
        out,
        "regenerate",
        config={"target": to_dict(cfg.target), "regenerate": to_dict(rc), "prepare": to_dict(pc)},
        target=describe_target(cfg.target),
        inputs={"data": inputs["data"]},
        counts=summary,
        output=OUTPUT,
        files=artifacts.file_record(out, [OUTPUT]),
    )
    print(
        f"[eyas:regenerate] wrote {path}: {total} conversations ({len(todo) - skipped} now, {len(done)} resumed"
        + (f", {skipped} not started: max_seconds" if skipped else "") + "), "
        f"{counts['turns']} turns, {counts['new_tokens']:,} new tokens in {seconds:.1f} s "
        f"({summary['tokens_per_s']:,.0f} tok/s); finish: stop {counts['finish_stop']}, length {counts['finish_length']}"
        + (f"; {counts['answers_refused']} answers refused ({refused_counts(counts)}): their conversations end before "
           "them" if counts["answers_refused"] else ""),
        flush=True,
    )
    return summary
