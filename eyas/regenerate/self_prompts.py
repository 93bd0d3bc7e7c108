"""Self-written user turns (`regenerate.self_prompts`, the Magpie method, Xu et al. 2024): the target
samples user turns from its chat template's text before a user message's content (`pre_query_ids`),
optionally after steering system prompts (`self_prompt_systems`); the distinct finished ones are
stored in `self_prompts.json` (read back on a resume) and answered like the data's conversations,
with source indices -1, -2, ..."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from eyas import artifacts
from eyas.chat import Conversation
from eyas.config import EyasConfig
from eyas.errors import EyasError, exception_message
from eyas.regenerate.backends import HFBackend, Sampling


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
    return {"samples": rc.self_prompts, "temperature": rc.self_prompt_temperature, "top_p": rc.self_prompt_top_p,
            "max_tokens": rc.self_prompt_max_tokens, "system_prompt": cfg.prepare.system_prompt, "seed": cfg.seed,
            "systems": list(rc.self_prompt_systems)}


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


def read_self_prompts(path: Path, output: Path, cfg: EyasConfig, done: set[int]) -> dict[str, Any] | None:
    """The self-written user turns sampled by an earlier run (None: sample them); checked before
    the model loads: other settings, or self-written answers in `output` (the conversations file)
    without their prompts, are errors."""
    fix = f"remove it and {output} (or restore the settings)"
    if not path.exists():
        if any(i < 0 for i in done):
            raise EyasError(f"regenerate: {output} holds answers to self-written user turns but "
                            f"{path} is gone: remove {output} too (new samples would not match them)")
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
