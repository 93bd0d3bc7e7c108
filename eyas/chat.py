"""Chat data in: ShareGPT, OpenAI and HF-datasets records -> normalised conversations.

A normalised conversation is `Conversation(id, messages=[{"role", "content"}])` with roles
`system` (optional, first), then alternating `user` / `assistant`, ending on `assistant`; each
content has its surrounding whitespace stripped and consecutive turns of one role are merged.
Everything that is changed or dropped on the way is counted by reason in a `Counter`, so prepare
can report it; a malformed line or an unknown role is an error naming file:line / the record.

Reasoning (the thinking block of a reasoning model) is kept as an assistant message's
`reasoning_content`, the key the chat templates of Qwen3, Kimi-K2 and DeepSeek-R1 read; a message
without reasoning has no such key. It comes from
  - a `reasoning_content` (or `reasoning`, vLLM's newer name) string on the turn, in both forms:
    OpenAI `{"role": "assistant", "content": ..., "reasoning_content": ...}` and ShareGPT
    `{"from": "gpt", "value": ..., "reasoning_content": ...}`;
  - else a thinking block written inline at the start of the content, `<think>...</think>answer`,
    split as Qwen3's chat template splits it (`split_think`): the reasoning is the text before the
    first `</think>` after the `<think>`, the content the text after the last `</think>`. An answer
    that does not open with `<think>` keeps its text whole (it may be about the tags).
Reasoning is stripped like content. An assistant turn with reasoning but no answer (a generation cut
off while thinking) is removed and counted (`removed_reasoning_without_answer`). Merged consecutive
assistant turns join their reasonings and their contents, each with a blank line, in order.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from eyas.errors import ConfigError, DataError, exception_message

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


REASONING = "reasoning_content"
"""The key of an assistant message's reasoning (what Qwen3's and Kimi's chat templates read)."""
THINK_START, THINK_END = "<think>", "</think>"


def split_think(text: str) -> tuple[str, str]:
    """(reasoning, content) of a text with an inline thinking block, split exactly as Qwen3's chat
    template splits an assistant content (`content.split('</think>')...`); ("", text) when the text
    has no `</think>`. The opening `<think>` may be absent (templates that end the generation prompt
    with it: the model writes only `reasoning</think>answer`)."""
    if THINK_END not in text:
        return "", text
    reasoning = text.split(THINK_END)[0].rstrip("\n").split(THINK_START)[-1].lstrip("\n")
    return reasoning, text.split(THINK_END)[-1].lstrip("\n")


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]
    index: int = -1
    """Position among the kept conversations of the source (stable across runs: the resume key)."""


COMPRESSED = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}
"""Suffixes of data files decompressed on the fly: data.jsonl.xz reads as data.jsonl."""


@contextmanager
def open_text(p: Path) -> Iterator[Any]:
    """A data file opened for reading text; .xz, .gz and .bz2 are decompressed as it is read. A
    compressed file cut short or not what its suffix says fails naming the file (the decompressors
    raise EOFError, LZMAError or OSError without it), also when that shows only mid-read. A byte that
    is not UTF-8 reads as a surrogate (surrogateescape) rather than failing the read where no line is
    known: `check_utf8` names its file:line."""
    opener = COMPRESSED.get(p.suffix)
    if opener is None:
        with open(p, encoding="utf-8", errors="surrogateescape") as f:
            yield f
        return
    try:
        with opener(p, "rt", encoding="utf-8", errors="surrogateescape") as f:
            yield f
    except (EOFError, lzma.LZMAError, OSError) as e:
        raise DataError(f"{p}: cannot decompress it as {p.suffix} ({type(e).__name__}: {exception_message(e)}); "
                        "is the file whole?") from None


def data_suffix(p: Path) -> str:
    """The suffix that says the format: ".jsonl" for data.jsonl and for data.jsonl.xz."""
    return Path(p.stem).suffix if p.suffix in COMPRESSED else p.suffix


def iter_records(path: str, fmt: str = "auto", on_bad: Callable[[DataError], None] | None = None
                 ) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (where, record) from a data source; `where` is file:line or file#index for errors. With
    `on_bad`, a JSONL line that cannot be read goes to it instead of failing the read."""
    from eyas import assets

    if path == "embedded:sharegpt":
        src = assets.sharegpt_path()
        for i, rec in assets.iter_json_array(src, stop_at_truncation=True):
            yield f"{src.name}#{i}", rec
        return
    if path.startswith("embedded:"):
        raise ConfigError(f"prepare.data={path!r}: the embedded data set is embedded:sharegpt")
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"prepare.data={path!r}: no such file or directory")
    if p.is_dir() or fmt == "hf":
        yield from _iter_hf(p)
        return
    if data_suffix(p) == ".jsonl":
        yield from iter_jsonl(p, on_bad)
        return
    # .json: an array of records (parsed record by record) or, like .jsonl, one object per line
    with open_text(p) as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        for i, rec in assets.iter_json_array(p, stop_at_truncation=False):
            if not isinstance(rec, dict):
                raise DataError(f"{p}#{i}: expected a JSON object per record, got {type(rec).__name__}")
            yield f"{p.name}#{i}", rec
    elif head.startswith("{"):
        yield from iter_jsonl(p, on_bad)
    else:
        raise DataError(f"{p}:1: expected a JSON array of records or one JSON object per line")


def iter_jsonl(p: Path, on_bad: Callable[[DataError], None] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file:line, record) per line; a line that cannot be read is a DataError, or goes to `on_bad`."""
    with open_text(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{p.name}:{lineno}", read_line(p, lineno, line)
            except DataError as e:
                if on_bad is None:
                    raise
                on_bad(e)


def read_line(p: Path, lineno: int, line: str) -> dict[str, Any]:
    """One JSONL line as a record: UTF-8, JSON, an object, or a DataError naming p:lineno."""
    check_utf8(line, p, lineno)
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{p}:{lineno}: malformed JSON line: {json_error_where(line, e)}") from None
    if not isinstance(rec, dict):
        raise DataError(f"{p}:{lineno}: expected a JSON object per line, got {type(rec).__name__}")
    return rec


def check_utf8(text: str, path: Path, lineno: int = 1) -> None:
    """A DataError naming path:line and the column of the first byte in `text` (which starts at line
    `lineno` of the file) that is not UTF-8: read with errors="surrogateescape", such a byte is a
    surrogate U+DC80..U+DCFF there."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00
        line_start = text.rfind("\n", 0, e.start) + 1
        raise DataError(
            f"{path}:{lineno + text.count(chr(10), 0, e.start)}: not valid UTF-8: byte 0x{byte:02x} at column "
            f"{e.start - line_start + 1}, after {text[max(line_start, e.start - 30):e.start]!r}; convert the file "
            "to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove that line") from None


def json_error_where(line: str, e: json.JSONDecodeError) -> str:
    """What json says and where, on the line itself: a line that ends before its value is complete (a
    cut line) is said so, rather than as "column 1" of the next line; elsewhere the column and the
    text just before it."""
    body = line.rstrip("\r\n")
    open_string = e.msg.startswith("Unterminated string") and '"' not in body[e.pos + 1:]
    if e.pos >= len(body.rstrip()) or open_string:
        return f"{e.msg.removesuffix(' at').removesuffix(' starting')}: the line ends (column {len(body) + 1}) before its JSON value " \
               "is complete; was it cut short?"
    return f"{e.msg.removesuffix(' at')} at column {e.pos + 1}, after {body[max(0, e.pos - 30):e.pos]!r}"


def _iter_hf(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"prepare.data={str(p)!r} is a directory: reading HF datasets needs `pip install datasets`") from None
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{p}: a DatasetDict without a 'train' split (splits: {list(ds)})")
        ds = ds["train"]
    for i, rec in enumerate(ds):
        yield f"{p.name}#{i}", rec


def normalise(where: str, rec: dict[str, Any], fmt: str, counts: Counter, system_prompt: str = "") -> Conversation | None:
    """One raw record -> Conversation, or None (dropped; the reason is counted)."""
    if fmt in ("auto", "hf"):
        # (a datasets table has every column in every row: an absent field reads as None)
        fmt = "sharegpt" if rec.get("conversations") is not None else "openai" if rec.get("messages") is not None else ""
        if not fmt:
            raise DataError(f"{where}: record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI); keys: {sorted(rec)}")
    key, role_key, text_key = ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
    turns = rec.get(key)
    if turns is None:
        raise DataError(f"{where}: record has no '{key}' list (format {fmt})")
    if not isinstance(turns, list):
        raise DataError(f"{where}: '{key}' must be a list, got {type(turns).__name__}")
    rid = str(rec.get("id", rec.get("conversation_id", where)))
    if not turns:
        counts["dropped_empty_record"] += 1
        return None
    messages: list[dict[str, str]] = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn:
            raise DataError(f"{where} (id {rid}): turn {j} has no '{role_key}' field: {str(turn)[:120]!r}")
        raw_role = str(turn[role_key])
        role = ROLE_MAP.get(raw_role.lower())
        if role is None:
            raise DataError(
                f"{where} (id {rid}): unknown role {raw_role!r} in turn {j}; known roles: {', '.join(sorted(ROLE_MAP))}"
            )
        content = turn_content(turn.get(text_key), f"{where} (id {rid}): turn {j} '{text_key}'")
        reasoning = turn_reasoning(turn, f"{where} (id {rid}): turn {j}") if role == "assistant" else ""
        # an inline block only where the answer opens with one: a `</think>` inside an answer's text
        # (an answer about the tags) is its text, not reasoning
        if role == "assistant" and not reasoning and isinstance(content, str) and THINK_END in content \
                and content.lstrip().startswith(THINK_START):
            reasoning, content = split_think(content)
            counts["reasoning_split_from_content"] += 1
        reasoning = reasoning.strip()
        if not content.strip():
            counts["removed_reasoning_without_answer" if reasoning else "removed_empty_turn"] += 1
            continue
        # Surrounding whitespace is data noise, and leading whitespace would merge with the
        # template's own "\n" into one token that belongs half to the template.
        content = content.strip()
        if role == "system" and messages:
            counts["removed_system_turn_not_first"] += 1
            continue
        if messages and messages[-1]["role"] == role:
            last = messages[-1]
            last["content"] += "\n\n" + content
            if reasoning:
                last[REASONING] = last[REASONING] + "\n\n" + reasoning if REASONING in last else reasoning
            counts["merged_consecutive_turns"] += 1
            continue
        messages.append({"role": role, "content": content, **({REASONING: reasoning} if reasoning else {})})
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if body and body[0]["role"] == "assistant":
        body = body[1:]
        counts["removed_leading_assistant_turn"] += 1
    while body and body[-1]["role"] != "assistant":
        body = body[:-1]
        counts["removed_trailing_user_turn"] += 1
    if not any(m["role"] == "assistant" for m in body):
        counts["dropped_no_user_assistant_pair"] += 1
        return None
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    if not system and system_prompt:
        system = [{"role": "system", "content": system_prompt}]
    return Conversation(rid, system + body)


def turn_content(content: Any, where: str) -> str:
    """A turn's text: a string, OpenAI content parts (their `text`s joined; parts without text, such as
    images, add none) or null (an empty turn, as an assistant turn that only calls tools). Anything
    else (a number, a mapping), a part whose text is not a string, and text that is not valid Unicode
    (a lone surrogate such as \\ud800, which no tokenizer encodes) is a DataError naming `where`:
    such a turn is a broken record, not an empty one."""
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            text = part.get("text", "") if isinstance(part, dict) else part
            if not isinstance(text, str):
                raise DataError(f"{where} part {k}: the text must be a string, got {type(text).__name__} "
                                f"{str(text)[:60]!r}; write it as text (in quotes) or remove the part")
            texts.append(text)
        content = "".join(texts)
    if not isinstance(content, str):
        raise DataError(f"{where}: expected text (a string or a list of text parts), got {type(content).__name__} "
                        f"{str(content)[:60]!r}; write it as text (in quotes) or remove the turn")
    check_unicode(content, where)
    return content


def check_unicode(text: str, where: str) -> None:
    """A DataError naming `where` and the character of a lone surrogate in `text` (JSON's `\\ud800`
    escapes decode to one: not Unicode text, the tokenizer refuses it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start + 1}, after "
                        f"{text[max(0, e.start - 30):e.start]!r}: not valid Unicode (half of a UTF-16 pair?); fix "
                        "or remove it in the data") from None


def turn_reasoning(turn: dict[str, Any], where: str) -> str:
    """The reasoning a turn carries in `reasoning_content` or `reasoning` ("" when none)."""
    for key in (REASONING, "reasoning"):
        value = turn.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
        check_unicode(value, f"{where} '{key}'")
        if value.strip():
            return value
    return ""


def load_conversations(
    path: str, fmt: str = "auto", limit: int = 0, system_prompt: str = "", skip_bad: bool = False
) -> tuple[list[Conversation], Counter]:
    """Read and normalise up to `limit` records (0 = all). Returns (conversations, counts by reason).
    `skip_bad` (prepare.skip_bad_records): a record that cannot be read or normalised is dropped and
    counted as `dropped_bad_record` (the first few said on stderr) instead of failing the read."""
    counts: Counter = Counter()
    out: list[Conversation] = []
    said: list[str] = []

    def bad(e: DataError) -> None:
        counts["dropped_bad_record"] += 1
        if len(said) < 5:
            said.append(str(e))

    for where, rec in iter_records(path, fmt, bad if skip_bad else None):
        if limit and counts["records"] + counts["dropped_bad_record"] >= limit:
            break
        counts["records"] += 1
        try:
            conv = normalise(where, rec, fmt, counts, system_prompt)
        except DataError as e:
            if not skip_bad:
                raise
            counts["records"] -= 1  # counted once, as a bad record
            bad(e)
            continue
        if conv is not None:
            conv.index = len(out)
            out.append(conv)
    counts["records"] += counts["dropped_bad_record"]
    if said:
        print(f"[eyas:data] prepare.skip_bad_records: dropped {counts['dropped_bad_record']} record(s) that cannot "
              "be read; the first:\n  " + "\n  ".join(said), file=sys.stderr, flush=True)
    if counts["records"] == 0:
        raise DataError(f"prepare.data={path!r} holds no records")
    if not out:
        raise DataError(
            f"prepare.data={path!r}: none of {counts['records']} records has a user turn followed by an "
            f"assistant turn (drop reasons: {dict(counts)})"
        )
    return out, counts
