"""regenerate: the target rewrites every assistant turn, turn by turn, given the conversation so far.

    eyas regenerate recipe.yaml                               # in-process HF generate (default)
    eyas regenerate --backend server --server_url http://127.0.0.1:8000   # vllm serve / SGLang

Answers written by the target itself are the largest single lever on draft acceptance (EAGLE-3
paper and every public reproduction): the draft learns the distribution it will have to predict.

For a conversation [system?, u1, a1, u2, a2, ...] the output is [system?, u1, a1', u2, a2', ...]
where a1' is generated from [system?, u1] and a2' from [system?, u1, a1', u2]. Conversations are
processed in chunks (`chunk_conversations`); round r of a chunk generates turn r of every
conversation in it as one batch. A chunk is appended to `conversations.jsonl` (OpenAI form, one
record per line, fsync'd) only when all its turns are done, so re-running the same command skips
every completed conversation and redoes at most one chunk. A turn whose prompt exceeds
`max_prompt_tokens` ends its conversation there (counted).

`self_prompts` adds conversations the target starts itself (Magpie, Xu et al. 2024): it samples
user turns from its chat template's text before a user message's content (`pre_query_ids`); the
distinct finished ones are stored in `self_prompts.json` (read back on a resume) and answered in
the same chunks after the data's conversations, with source indices -1, -2, ...

Backends: `HFBackend.generate(token prompts, sampling) -> list[Answer]`, `ServerBackend.generate_messages(chats, ids)`.
  hf      prompts sorted by length, left-padded, batched. On CUDA (`static_cache`, default): eyas's
          BatchDecoder (eyas/spec/static.py): fixed-size KV buffers and the decode step of all rows
          as one CUDA graph (captured in a forward's time, no compilation), rows filled up to a
          power of two, prompt widths bucketed (`static_widths`). Elsewhere: transformers `generate`.
  server  OpenAI-compatible /v1/chat/completions with bounded concurrency; connection errors,
          HTTP 429 and 5xx are retried `retries` times with backoff, then the run fails naming the
          conversation, the attempts and the last error. Nothing is skipped silently.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas import artifacts
from eyas.chat import Conversation, load_conversations
from eyas.config import EyasConfig, dump_config, to_dict
from eyas.errors import EyasError, exception_message
from eyas.target import describe_target, load_tokenizer

OUTPUT = "conversations.jsonl"


@dataclass
class Answer:
    text: str
    new_tokens: int
    finish_reason: str  # "stop" | "length"


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int


class HFBackend:
    """Batched in-process generation with the target (greedy or sampled)."""

    def __init__(self, cfg: EyasConfig, tok):
        import torch

        from eyas.target import load_model

        rc = cfg.regenerate
        self.rc, self.tok = rc, tok
        self.device = rc.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_model(cfg.target, device=self.device)
        self.eos = _eos_ids(self.model, tok)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos[0]
        self.static = rc.static_cache and self.device.startswith("cuda")
        self.widths = sorted(rc.static_widths or {512, rc.max_prompt_tokens})
        self.decoder = None
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed)  # eyas's decoder samples with it
        torch.manual_seed(cfg.seed)  # transformers' generate samples from the global generator
        self.answers = Sampling(rc.temperature, rc.top_p, rc.max_new_tokens)

    def generate(self, prompts_ids: list[list[int]], sampling: Sampling | None = None) -> list[Answer]:
        """Continuations of the token prompts; `sampling` defaults to the answers' settings."""
        s = sampling or self.answers
        order = sorted(range(len(prompts_ids)), key=lambda i: len(prompts_ids[i]))
        out: list[Answer | None] = [None] * len(prompts_ids)
        for b in range(0, len(order), self.rc.batch_size):
            idx = order[b : b + self.rc.batch_size]
            batch = [prompts_ids[i] for i in idx]
            if self.static:
                new = self._static_batch(batch, s)
            else:
                new = self._hf_batch(batch, s)
            for row, i in enumerate(idx):
                out[i] = self._answer(new[row])
        return out  # type: ignore[return-value]

    def _pick(self, logits_BV, s: Sampling):
        import torch

        if s.temperature == 0:
            return logits_BV.argmax(-1)
        from eyas.spec.sampling import logits_to_probs

        probs = logits_to_probs(logits_BV.float(), s.temperature)
        if s.top_p < 1.0:
            p_sorted, idx = probs.sort(-1, descending=True)
            drop = p_sorted.cumsum(-1) - p_sorted > s.top_p
            probs = probs.scatter(-1, idx, p_sorted.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=self.generator).view(-1)

    def _static_batch(self, batch: list[list[int]], s: Sampling) -> list[list[int]]:
        """eyas's batched decoder (SlotCache + one CUDA graph per decode shape); rows and width bucketed."""
        from eyas.spec.static import BatchDecoder

        width = static_width(max(len(p) for p in batch), self.widths)
        # rows: the batch size, or the next power of two for a short batch (a width bucket's few
        # prompts, a round's last ones): graphs need no compilation, so a new shape costs one
        # capture, while filler rows would cost a whole batch of decode steps
        rows = min(self.rc.batch_size, max(8, 1 << (len(batch) - 1).bit_length()))
        if self.decoder is None or (self.decoder.rows, self.decoder.width, self.decoder.max_new) != (rows, width, s.max_new_tokens):
            self.decoder = None  # one decoder's caches at a time
            if self.device.startswith("cuda"):
                import torch

                torch.cuda.empty_cache()
            self.decoder = BatchDecoder(self.model, rows, width, s.max_new_tokens)
        return self.decoder.generate(batch, set(self.eos), self.pad, lambda logits_BV: self._pick(logits_BV, s))

    def _hf_batch(self, batch: list[list[int]], s: Sampling) -> list[list[int]]:
        import torch

        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):  # left padding: generation continues from the right edge
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        kw: dict[str, Any] = dict(
            max_new_tokens=s.max_new_tokens,
            do_sample=s.temperature > 0,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        if s.temperature > 0:
            kw.update(temperature=s.temperature, top_p=s.top_p, top_k=0)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kw)
        return gen[:, width:].cpu().tolist()  # one host sync per batch

    def _answer(self, new: list[int]) -> Answer:
        n, reason = len(new), "length"
        for j, t in enumerate(new):
            if t in self.eos:
                n, reason = j + 1, "stop"
                break
        text = self.tok.decode(new[:n], skip_special_tokens=True)
        return Answer(text.strip(), n, reason)


def static_width(width: int, widths: list[int]) -> int:
    """The smallest compiled width that holds a prompt batch of `width` tokens."""
    for w in widths:
        if width <= w:
            return w
    raise EyasError(f"regenerate: a prompt of {width} tokens is wider than every regenerate.static_widths {widths}")


def _eos_ids(model, tok) -> list[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    if not ids:
        raise EyasError("the target defines no eos token (generation_config.eos_token_id / tokenizer.eos_token)")
    return sorted(ids)


class ServerBackend:
    """An OpenAI-compatible /v1/chat/completions endpoint (vllm serve, SGLang, ...)."""

    def __init__(self, cfg: EyasConfig):
        self.rc = cfg.regenerate
        self.url = self.rc.server_url.rstrip("/") + "/v1/chat/completions"
        self.model = self.rc.server_model or cfg.target.model
        self.retried = 0

    def generate_messages(self, prompts: list[list[dict[str, str]]], ids: list[str]) -> list[Answer]:
        with ThreadPoolExecutor(max_workers=self.rc.concurrency) as pool:
            return list(pool.map(self._one, prompts, ids))

    def _one(self, messages: list[dict[str, str]], conv_id: str) -> Answer:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.rc.max_new_tokens,
            "temperature": self.rc.temperature,
            "top_p": self.rc.top_p,
            **self.rc.extra_body,
        }
        data = json.dumps(body).encode()
        last = ""
        for attempt in range(self.rc.retries + 1):
            if attempt:
                self.retried += 1
                time.sleep(min(2.0 ** (attempt - 1), 30.0))
            req = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.rc.timeout_s) as resp:
                    payload = json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:2000]
                last = f"HTTP {e.code} {e.reason}: {detail}"
                if e.code == 429 or e.code >= 500:
                    continue
                raise EyasError(f"regenerate: {self.url} refused conversation {conv_id}: {last}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                last = f"{type(e).__name__}: {exception_message(e)}"
                continue
            try:
                choice = payload["choices"][0]
                text = choice["message"]["content"] or ""
                n = int((payload.get("usage") or {}).get("completion_tokens", 0))
                reason = choice.get("finish_reason") or "stop"
            except (KeyError, IndexError, TypeError) as e:
                raise EyasError(f"regenerate: malformed response from {self.url} for conversation {conv_id}: {str(payload)[:500]}") from e
            return Answer(text.strip(), n, "length" if reason == "length" else "stop")
        raise EyasError(
            f"regenerate: conversation {conv_id} failed after {self.rc.retries + 1} attempts at {self.url}; last error: {last}"
        )


def regenerate_chunk(backend, tok, convs: list[Conversation], rc, counts: Counter) -> list[dict[str, Any]]:
    """All turns of `convs`, round by round (turn r of every conversation in one batch)."""
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
            s["messages"] = msgs + [{"role": "assistant", "content": a.text}]
            s["reasons"].append(a.finish_reason)
            counts["turns"] += 1
            counts["new_tokens"] += a.new_tokens
            counts[f"finish_{a.finish_reason}"] += 1
            if not a.text:
                counts["empty_answers"] += 1
    out = []
    for s in states:
        if not any(m["role"] == "assistant" for m in s["messages"]):
            counts["dropped_prompt_too_long"] += 1
            continue
        out.append({"id": s["conv"].id, "source_index": s["index"], "messages": s["messages"], "finish_reasons": s["reasons"]})
    return out


SELF_PROMPTS = "self_prompts.json"
_SENTINEL = "\u2063eyas user turn\u2063"


def _head(system: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def pre_query_ids(tok, eos: list[int], system: str = "") -> list[int]:
    """Token ids of the chat template's text before a first user message's content (after
    `system`, else the system prompt the template adds by itself, if any): what the target
    continues to write a user turn. Checked against the template's own tokens of a real
    conversation (a template whose text does not tokenize the same cut there fails here, not in the
    samples), and the user turn must end with one of the `eos` ids the target stops at."""
    text = tok.apply_chat_template(_head(system) + [{"role": "user", "content": _SENTINEL}], tokenize=False)
    if not isinstance(text, str) or text.count(_SENTINEL) != 1:
        raise EyasError("regenerate.self_prompts: the chat template does not place a user message's content "
                        "verbatim once, so there is no text before it to sample a user turn from")
    before, after = text.split(_SENTINEL)
    ids = list(tok(before, add_special_tokens=False)["input_ids"])
    real = list(tok.apply_chat_template(_head(system) + [{"role": "user", "content": "Hello there."}], tokenize=True,
                                        return_dict=False))
    if not ids or real[: len(ids)] != ids:
        raise EyasError(f"regenerate.self_prompts: the chat template's text before the user's content tokenizes as "
                        f"{ids[:16]}..., not as the start of a templated conversation {real[:16]}...")
    end = list(tok(after, add_special_tokens=False)["input_ids"])[:1]
    if not end or end[0] not in eos:
        raise EyasError(f"regenerate.self_prompts: this chat template ends a user turn with {tok.decode(end)!r}, not "
                        f"with a token the target stops at ({tok.convert_ids_to_tokens(eos)}): a sampled user turn "
                        "would run on into its answer; leave regenerate.self_prompts at 0 for this target")
    return ids


def self_prompt_settings(cfg: EyasConfig) -> dict[str, Any]:
    rc = cfg.regenerate
    settings = {"samples": rc.self_prompts, "temperature": rc.self_prompt_temperature, "top_p": rc.self_prompt_top_p,
                "max_tokens": rc.self_prompt_max_tokens, "system_prompt": cfg.prepare.system_prompt, "seed": cfg.seed}
    if rc.self_prompt_systems:  # absent otherwise: files sampled before the key existed still match
        settings["systems"] = list(rc.self_prompt_systems)
    return settings


def sample_self_prompts(backend: HFBackend, tok, cfg: EyasConfig) -> dict[str, Any]:
    """rc.self_prompts user turns sampled by the target from pre_query_ids; the distinct finished
    ones kept, in order, with counts of what was dropped (none kept is an error)."""
    rc = cfg.regenerate
    systems = rc.self_prompt_systems or [cfg.prepare.system_prompt]
    prefixes = [pre_query_ids(tok, backend.eos, system) for system in systems]
    answers = backend.generate([prefixes[i % len(prefixes)] for i in range(rc.self_prompts)],
                               Sampling(rc.self_prompt_temperature, rc.self_prompt_top_p, rc.self_prompt_max_tokens))
    kept: list[str] = []
    seen: set[str] = set()
    counts: dict[str, Any] = Counter({"sampled": len(answers), "unfinished": 0, "empty": 0, "duplicate": 0})
    per_system = [0] * len(systems)
    for i, a in enumerate(answers):
        if a.finish_reason != "stop":
            counts["unfinished"] += 1
        elif not a.text:
            counts["empty"] += 1
        elif a.text in seen:
            counts["duplicate"] += 1
        else:
            seen.add(a.text)
            kept.append(a.text)
            per_system[i % len(systems)] += 1
    counts["kept"] = len(kept)
    if rc.self_prompt_systems:
        counts["kept_per_system"] = per_system
    if not kept:
        raise EyasError(f"regenerate.self_prompts: none of the {len(answers)} sampled user turns was kept "
                        f"({dict(counts)}): raise regenerate.self_prompt_max_tokens or the number of samples")
    return {"settings": self_prompt_settings(cfg), "counts": dict(counts), "prompts": kept}


def read_self_prompts(path: Path, cfg: EyasConfig, done: set[int]) -> dict[str, Any] | None:
    """The self-written user turns sampled by an earlier run (None: sample them); checked before
    the model loads: other settings, or self-written answers without their prompts, are errors."""
    fix = f"remove it and {path.parent / OUTPUT} (or restore the settings)"
    if not path.exists():
        if any(i < 0 for i in done):
            raise EyasError(f"regenerate: {path.parent / OUTPUT} holds answers to self-written user turns but "
                            f"{path} is gone: remove {path.parent / OUTPUT} too (new samples would not match them)")
        return None
    try:
        made = json.loads(path.read_text())
        settings, _, _ = made["settings"], made["prompts"], made["counts"]
    except (ValueError, KeyError, TypeError) as e:
        raise EyasError(f"regenerate: {path} is not a self_prompts file ({type(e).__name__}: {exception_message(e)}): {fix}") from e
    if settings != self_prompt_settings(cfg):
        raise EyasError(f"regenerate: {path} was sampled with {settings}, not the configured {self_prompt_settings(cfg)}: {fix}")
    return made


def self_conversations(path: Path, made: dict[str, Any] | None, backend, tok, cfg: EyasConfig) -> tuple[list[Conversation], dict[str, Any]]:
    """The self-written single-turn conversations: `made` (read back by read_self_prompts), else
    sampled now and stored in `path`; indices -1, -2, ...: apart from the data's."""
    if made is not None:
        print(f"[eyas:regenerate] self-written user turns: {len(made['prompts'])} read from {path}", flush=True)
    else:
        t0 = time.perf_counter()
        made = sample_self_prompts(backend, tok, cfg)
        artifacts.atomic_write_text(path, json.dumps(made, ensure_ascii=False))
        c = made["counts"]
        print(f"[eyas:regenerate] self-written user turns: {c['kept']} kept of {c['sampled']} sampled "
              f"({c['unfinished']} unfinished, {c['empty']} empty, {c['duplicate']} repeated"
              + (f"; kept per system prompt {c['kept_per_system']}" if "kept_per_system" in c else "")
              + f") in {time.perf_counter() - t0:.1f} s", flush=True)
    head = _head(cfg.prepare.system_prompt)
    convs = [Conversation(f"self-{k}", head + [{"role": "user", "content": text}], -1 - k)
             for k, text in enumerate(made["prompts"])]
    return convs, made["counts"]


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
        with open(path, "r+b") as f:
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
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def main(cfg: EyasConfig) -> dict[str, Any]:
    from tqdm import tqdm

    rc, pc = cfg.regenerate, cfg.prepare
    out = cfg.stage_dir("regenerate")
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(cfg.target)
    convs, load_counts = load_conversations(pc.data, pc.format, pc.max_conversations, pc.system_prompt)
    path = out / OUTPUT
    done = read_done(path)
    made = read_self_prompts(out / SELF_PROMPTS, cfg, done) if rc.self_prompts else None
    # checked what is cheap: from here the output is incomplete until this run finishes
    (out / "meta.json").unlink(missing_ok=True)
    artifacts.atomic_write_text(out / "config.yaml", dump_config(cfg))
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
    for b in range(0, len(todo), rc.chunk_conversations):
        ahead = len(todo[b : b + rc.chunk_conversations])
        if b and out_of_time(time.perf_counter() - t0, per_batch, ahead, rc):  # a run always makes progress
            skipped = len(todo) - b
            print(f"\n[eyas:regenerate] regenerate.max_seconds={rc.max_seconds:g} reached: {skipped} conversations "
                  "left for a later run", flush=True)
            break
        chunk = todo[b : b + rc.chunk_conversations]
        t_chunk = time.perf_counter()
        before = counts["new_tokens"]
        records = regenerate_chunk(backend, tok, chunk, rc, counts)
        append_records(path, records)
        dt = time.perf_counter() - t_chunk
        per_batch = max(per_batch, dt / batches(len(chunk), rc.batch_size))
        tqdm.write(f"[eyas:regenerate] chunk of {len(chunk)} conversations: {counts['new_tokens'] - before:,} new tokens "
                   f"in {dt:.1f} s ({(counts['new_tokens'] - before) / max(dt, 1e-9):,.0f} tok/s)")
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{counts['new_tokens'] / max(time.perf_counter() - t0, 1e-9):,.0f}")
    bar.close()
    seconds = time.perf_counter() - t0
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
    }
    artifacts.write_meta(
        out,
        "regenerate",
        config={"target": to_dict(cfg.target), "regenerate": to_dict(rc), "prepare": to_dict(pc)},
        target=describe_target(cfg.target),
        counts=summary,
        output=OUTPUT,
    )
    print(
        f"[eyas:regenerate] wrote {path}: {total} conversations ({len(todo) - skipped} now, {len(done)} resumed"
        + (f", {skipped} not started: max_seconds" if skipped else "") + "), "
        f"{counts['turns']} turns, {counts['new_tokens']:,} new tokens in {seconds:.1f} s "
        f"({summary['tokens_per_s']:,.0f} tok/s); finish: stop {counts['finish_stop']}, length {counts['finish_length']}",
        flush=True,
    )
    return summary
