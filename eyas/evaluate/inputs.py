"""What an evaluation reads: the bench's prompts rendered with the target's chat template, its
end-of-turn tokens, where the target runs, and the target-only outputs of an earlier evaluation
(`target_outputs.json`, which evaluate.target_outputs reads back instead of decoding again)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch

from eyas import artifacts
from eyas.assets import sha256_file
from eyas.chat import check_unicode, check_utf8, json_error_where, open_text
from eyas.config import EyasConfig
from eyas.errors import ConfigError, DataError, exception_message
from eyas.evaluate.lossless import first_divergence
from eyas.spec import Generation
from eyas.target import describe_target, resolve_dtype


def load_bench(bench: str, num_questions: int = 0) -> list[dict[str, Any]]:
    """-> [{"id", "turns": [user message, ...]}]: MT-bench or a JSONL file (see EvaluateConfig.bench)."""
    from eyas.assets import load_mtbench

    if bench in ("mtbench", "embedded:mtbench"):
        questions = [
            {"id": str(q.get("question_id", i)), "turns": list(q["turns"])} for i, q in enumerate(load_mtbench())
        ]
    else:
        path = Path(bench)
        if not path.is_file():
            raise ConfigError(f"evaluate.bench={bench!r}: not `mtbench` and no such file")
        questions = []
        with open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    check_utf8(line, path, lineno)
                    questions.append(_bench_record(path, lineno, line))
        if not questions:
            raise DataError(f"{path}: no prompts (expected one JSON object or string per line)")
    return questions[:num_questions] if num_questions else questions


def _bench_record(path: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: malformed JSON line: {json_error_where(line, e)}") from None
    if isinstance(rec, str):
        rec = {"turns": [rec]}
    elif isinstance(rec, dict) and "turns" not in rec and isinstance(rec.get("prompt"), str):
        rec = {**rec, "turns": [rec["prompt"]]}
    turns = rec.get("turns") if isinstance(rec, dict) else None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DataError(
            f'{path}:{lineno}: expected {{"turns": [non-empty strings]}}, {{"prompt": "..."}} or a JSON string'
        )
    for i, turn in enumerate(turns):
        check_unicode(turn, f"{path}:{lineno}: turn {i}")
    return {"id": str(rec.get("question_id", rec.get("id", lineno))), "turns": turns}


def with_context(questions: list[dict[str, Any]], tok, min_tokens: int) -> list[dict[str, Any]]:
    """evaluate.context_tokens: each question with a `history` of earlier real turns (the embedded
    ShareGPT's user/assistant pairs, in order, none used twice) long enough that its first turn
    renders to >= min_tokens tokens; 0 = the questions unchanged."""
    if min_tokens <= 0:
        return questions
    pairs = sharegpt_pairs()
    out = []
    for q in questions:
        history: list[dict[str, str]] = []
        while len(render(tok, history + [{"role": "user", "content": q["turns"][0]}])) < min_tokens:
            pair = next(pairs, None)
            if pair is None:
                raise ConfigError(f"evaluate.context_tokens={min_tokens}: the embedded ShareGPT ran out of turns "
                                  f"before question {q['id']}; use fewer questions or a smaller context")
            history += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        out.append({**q, "history": history})
    return out


def sharegpt_pairs():
    """(user, assistant) texts of consecutive human/gpt turns of the embedded ShareGPT, in order."""
    from eyas.assets import iter_json_array, sharegpt_path

    for _, rec in iter_json_array(sharegpt_path()):
        turns = rec.get("conversations") or []
        for a, b in zip(turns, turns[1:]):
            if (a.get("from"), b.get("from")) == ("human", "gpt") and str(a.get("value", "")).strip() \
                    and str(b.get("value", "")).strip():
                yield a["value"], b["value"]


def bench_hash(bench: str) -> str:
    from eyas.assets import mtbench_path

    return sha256_file(mtbench_path() if bench in ("mtbench", "embedded:mtbench") else bench)


def render(tok, messages: list[dict[str, str]]) -> list[int]:
    """The target's chat template with the generation prompt, tokenised without extra specials."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tok, target) -> frozenset[int]:
    """End-of-turn ids: the tokenizer's eos and the generation config's eos list."""
    ids = set()
    for src in (tok.eos_token_id, getattr(getattr(target, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return frozenset(ids)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"evaluate.device={name!r} but CUDA is not available; use --evaluate.device=cpu")
    return torch.device(name)


def target_placement(cfg: EyasConfig):
    """-> (device, the target config with evaluate.dtype applied, its torch dtype)."""
    ec = cfg.evaluate
    device = resolve_device(ec.device)
    target_cfg = dataclasses.replace(cfg.target, dtype=ec.dtype) if ec.dtype else cfg.target
    return device, target_cfg, resolve_dtype(target_cfg.dtype, str(device))


TARGET_OUTPUTS = "target_outputs.json"
"""Written by every greedy evaluation that decodes target-only; evaluate.target_outputs reads it."""


def outputs_key(cfg: EyasConfig, questions: list[dict[str, Any]]) -> dict[str, Any]:
    """What target-only greedy outputs depend on, known before any model loads (the chat template
    is checked afterwards, by rendering every prompt again)."""
    device, _, dtype = target_placement(cfg)
    target = {k: v for k, v in describe_target(cfg.target).items() if k not in ("dtype", "path")}  # where, not what
    if "asset" in target:  # an embedded target: its file's sha256, not where the package put it
        target["asset"] = {k: v for k, v in target["asset"].items() if k != "source"}
    key = {"target": target, "dtype": str(dtype).replace("torch.", ""), "device": device.type,
           "bench": bench_hash(cfg.evaluate.bench), "questions": [q["id"] for q in questions],
           "max_new_tokens": cfg.evaluate.max_new_tokens}
    if cfg.evaluate.context_tokens:  # the prompts carry earlier turns
        key["context_tokens"] = cfg.evaluate.context_tokens
    if device.type == "cuda":  # static caches and graphs round bf16 otherwise than transformers' own decoding
        key["cuda_graphs"] = cfg.evaluate.cuda_graphs
    return key


def write_target_outputs(out_dir: Path, key: dict[str, Any], runs: list[dict[str, Any]], complete: bool) -> None:
    artifacts.atomic_write_json(out_dir / TARGET_OUTPUTS, {"key": key, "complete": complete, "runs": [
        {"id": r["id"], "turn": r["turn"], "prompt_ids": r["prompt_ids"], "tokens": r["gen"].tokens,
         "wall_s": r["gen"].wall_s} for r in runs]})


def read_target_outputs(where: str, key: dict[str, Any]) -> tuple[Path, list[dict[str, Any]]]:
    """evaluate.target_outputs -> (the file, its runs), refused unless made under `key` and complete."""
    path = Path(where) / TARGET_OUTPUTS if Path(where).is_dir() else Path(where)
    if not path.is_file():
        raise ConfigError(f"evaluate.target_outputs={where!r}: no {path.name} there (a greedy evaluation that decodes "
                          f"target-only writes one into its output directory)")
    try:
        data = json.loads(path.read_text())
        theirs, runs, complete = data["key"], data["runs"], data["complete"]
        if not isinstance(theirs, dict) or not all(isinstance(r, dict) and {"id", "turn", "prompt_ids", "tokens",
                                                                           "wall_s"} <= r.keys() for r in runs):
            raise TypeError("a key that is no object, or a run without id, turn, prompt_ids, tokens or wall_s")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path}: not a {TARGET_OUTPUTS} ({type(e).__name__}: {exception_message(e)})") from e

    def shown(k, v):
        return f"{len(v)} questions" if k == "questions" and isinstance(v, list) else repr(v)

    diff = [f"{k} {shown(k, theirs.get(k))} there, {shown(k, v)} here" for k, v in key.items() if theirs.get(k) != v]
    if diff:
        raise ConfigError(f"evaluate.target_outputs={where!r} was decoded under other settings ({'; '.join(diff)}): "
                          f"drop evaluate.target_outputs to decode them again")
    if not complete:
        raise ConfigError(f"evaluate.target_outputs={where!r}: that evaluation stopped before its last question "
                          f"(evaluate.max_seconds); its {len(runs)} outputs do not cover these prompts")
    return path, runs


def replay(runs: list[dict[str, Any]], source: Path) -> Callable[[torch.Tensor], Generation]:
    """A target-only decoder for `run_conversations` that hands back stored outputs in order, each
    after checking that the prompt rendered here (from the stored earlier answers) is the stored one."""
    stored = iter(runs)

    def generate(ids: torch.Tensor) -> Generation:
        r = next(stored, None)
        if r is None:
            raise DataError(f"{source}: {len(runs)} outputs, fewer than the prompts asked for")
        if r["prompt_ids"] != ids.tolist():
            at = first_divergence(ids.tolist(), r["prompt_ids"])
            raise DataError(f"{source}: question {r['id']} turn {r['turn']}: the prompt renders to other tokens here "
                            f"(first difference at token #{at}): another tokenizer or chat template; drop "
                            f"evaluate.target_outputs to decode them again")
        return Generation(list(r["tokens"]), float(r["wall_s"]))

    return generate
