"""prepare with a slow (Python) tokenizer: Kimi's tiktoken TikTokenTokenizer (tests/tiktoken_tokenizer.py).

Slow tokenizers give no character offsets; eyas spells each token's bytes instead. Checked here
without eyas's span or offset code: (a) the ids and masks equal a sequence built by hand from
Kimi-K2.5's format (tiktoken encoding each piece), and the masked runs decode to the assistant
contents + <|im_end|>; (b) a fast (Rust) tokenizer of the same BPE, converted by transformers'
TikTokenConverter, gives the same ids, offsets and masks, including CJK and emoji whose bytes the
tokens split; (c) `eyas prepare` end to end on it; (d) a tokenizer whose tokens do not spell the
text is refused by name.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from eyas import Prepared
from eyas.chat import Conversation, load_conversations
from eyas.cli import main as cli
from eyas.config.target import TargetConfig
from eyas.errors import ConfigError
from eyas.prepare import byte_level_offsets, tokenize_conversations
from eyas.target import load_tokenizer, tokenizer_hash
from tests.test_prepare import HANDMADE, masked_runs
from tests.tiktoken_tokenizer import VOCAB_SIZE, special_tokens, write_kimi_tokenizer

pytest.importorskip("tiktoken")

NON_ASCII = [
    Conversation("cjk", [
        {"role": "user", "content": "你好，世界！今天天气怎么样？"},
        {"role": "assistant", "content": "今天天气很好🌞，适合散步。😀👍🏽 ✨"},
    ]),
    Conversation("mixed", [
        {"role": "system", "content": "Réponds en français, s'il te plaît."},
        {"role": "user", "content": "emoji🐈x and 日本語のテキスト"},
        {"role": "assistant", "content": "🐈🐕‍🦺 👨‍👩‍👧 — naïve café Ωμέγα 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 한국어"},
        {"role": "user", "content": "Спасибо!"},
        {"role": "assistant", "content": "Пожалуйста 🙂\n\n"},
    ]),
]  # fmt: skip


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    return write_kimi_tokenizer(tmp_path_factory.mktemp("kimi") / "tokenizer")


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(kimi_dir), trust_remote_code=True)
    assert not tok.is_fast and type(tok).__name__ == "TikTokenTokenizer" and len(tok) == VOCAB_SIZE
    return tok


@pytest.fixture(scope="module")
def kimi_fast(kimi_dir, kimi):
    """The same BPE and special tokens as a fast tokenizer (tokenizers' BPE, converted from tiktoken.model)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = [text for _, text in sorted(special_tokens().items())]  # in id order: ids VOCAB_SIZE-256 ...
    backend = TikTokenConverter(vocab_file=str(kimi_dir / "tiktoken.model"), pattern=kimi.pat_str,
                                extra_special_tokens=specials).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="[BOS]", eos_token="[EOS]",
                                   pad_token="[PAD]", unk_token="[UNK]")  # fmt: skip
    fast.chat_template = kimi.chat_template
    assert fast.is_fast and fast.convert_tokens_to_ids("<|im_end|>") == kimi.convert_tokens_to_ids("<|im_end|>")
    return fast


@pytest.fixture(scope="module")
def convs():
    sharegpt, _ = load_conversations("embedded:sharegpt", limit=60)
    return HANDMADE + NON_ASCII + sharegpt


def kimi_by_hand(tok, conv: Conversation) -> tuple[list[int], list[int]]:
    """Kimi-K2.5's rendering of a plain conversation, token by token: `<|im_{role}|>{role}<|im_middle|>`,
    `<think></think>` before an assistant content, the content, `<|im_end|>`; the content and the
    <|im_end|> after it are masked in. Each piece is encoded by tiktoken itself (`tok.model`): special
    tokens bound every piece, so the pieces' tokens are the whole text's."""
    sid = tok.convert_tokens_to_ids
    ids, mask = [], []
    for m in conv.messages:
        role = m["role"]
        head = [sid(f"<|im_{role}|>"), *tok.model.encode(role), sid("<|im_middle|>")]
        if role == "assistant":
            head += [sid("<think>"), sid("</think>")]
        body = tok.model.encode(m["content"], disallowed_special=())
        ids += [*head, *body, sid("<|im_end|>")]
        mask += [0] * len(head) + [int(role == "assistant")] * (len(body) + 1)
    return ids, mask


def splits_a_character(tok, ids: list[int]) -> bool:
    """Whether some ordinary token holds only part of a character's UTF-8 bytes."""
    for t in ids:
        if t < VOCAB_SIZE - 256:
            try:
                tok.model.decode_single_token_bytes(t).decode("utf-8")
            except UnicodeDecodeError:
                return True
    return False


# ---- (a) masks against Kimi's format, built by hand ------------------------------------------


def test_masks_equal_kimi_format_by_hand(kimi):
    convs = HANDMADE + NON_ASCII
    ids, masks, kept = tokenize_conversations(kimi, convs, 100_000, 4, Counter())
    assert kept == [c.id for c in convs]
    for conv, x, m in zip(convs, ids, masks):
        assert (x, m) == kimi_by_hand(kimi, conv), conv.id
    assert any(splits_a_character(kimi, x) for x in ids)  # the byte-to-character mapping was exercised


def test_masked_runs_are_the_assistant_contents(kimi, convs):
    ids, masks, kept = tokenize_conversations(kimi, convs, 100_000, 16, Counter())
    assert kept == [c.id for c in convs]
    for conv, x, m in zip(convs, ids, masks):
        text = kimi.apply_chat_template(conv.messages, tokenize=False, add_generation_prompt=False)
        assert x == kimi.encode(text)  # Kimi's own tiktoken encoding of the rendered text
        expected = [msg["content"] + "<|im_end|>" for msg in conv.messages if msg["role"] == "assistant"]
        assert masked_runs(kimi, x, m) == expected, conv.id


# ---- (b) the same BPE as a fast tokenizer: same ids, offsets, masks ------------------------------


def test_slow_offsets_equal_a_fast_tokenizer_of_the_same_bpe(kimi, kimi_fast, convs):
    slow = tokenize_conversations(kimi, convs, 100_000, 16, Counter())
    fast = tokenize_conversations(kimi_fast, convs, 100_000, 16, Counter())
    assert slow[2] == fast[2] == [c.id for c in convs]
    assert slow[0] == fast[0]
    assert slow[1] == fast[1]
    texts = [kimi.apply_chat_template(c.messages, tokenize=False, add_generation_prompt=False) for c in convs]
    enc = kimi_fast(texts, add_special_tokens=False, return_offsets_mapping=True)
    ours = byte_level_offsets(kimi, texts, enc["input_ids"], convs)
    assert [[tuple(o) for o in offs] for offs in enc["offset_mapping"]] == ours
    assert sum(splits_a_character(kimi, x) for x in slow[0]) >= 2


def test_truncation_cuts_through_a_character(kimi, kimi_fast):
    conv = Conversation("trunc", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "🐈" * 40}])
    for n in range(10, 30):
        a, b = (tokenize_conversations(t, [conv], n, 1, Counter()) for t in (kimi, kimi_fast))
        assert a == b, n


# ---- (c) eyas prepare end to end ---------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_model(kimi_dir, tmp_path_factory) -> Path:
    """A model directory for prepare: the Kimi tokenizer + a config.json of its vocabulary size."""
    import shutil

    from tests.models import tiny_config

    d = tmp_path_factory.mktemp("kimi") / "model"
    shutil.copytree(kimi_dir, d)
    tiny_config("llama", vocab=VOCAB_SIZE).save_pretrained(str(d))
    return d


def test_prepare_end_to_end(tmp_path, kimi_model, kimi, capsys):
    chats = tmp_path / "chats.jsonl"
    rows = [{"id": c.id, "messages": c.messages} for c in HANDMADE + NON_ASCII]
    sharegpt, _ = load_conversations("embedded:sharegpt", limit=40)
    rows += [{"id": c.id, "messages": c.messages} for c in sharegpt]
    chats.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    rc = cli(["prepare", f"--run_dir={tmp_path}", f"--target.model={kimi_model}", "--target.trust_remote_code=true",
              f"--prepare.data={chats}", "--prepare.max_length=100000", "--prepare.batch_size=8",
              "--prepare.num_workers=2"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    p = Prepared(tmp_path / "prepare")
    assert p.meta["counts"]["target_vocab_size"] == VOCAB_SIZE and p.t2d.numel() == VOCAB_SIZE
    loaded, _ = load_conversations(str(chats))  # as eyas reads the file (contents stripped)
    by_id = {c.id: c.messages for c in loaded}
    assert len(p) == len(rows) == len(loaded)
    for i in range(len(p)):
        s = p[i]
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        expected = [m["content"] + "<|im_end|>" for m in by_id[s["id"]] if m["role"] == "assistant"]
        assert masked_runs(kimi, ids, mask) == expected, s["id"]
    hand = {c.id: kimi_by_hand(kimi, c) for c in loaded}
    for i in range(0, len(p), 3):
        s = p[i]
        assert (s["input_ids"].tolist(), s["loss_mask"].tolist()) == hand[s["id"]], s["id"]
    assert p.meta["hashes"]["tokenizer"] == tokenizer_hash(kimi)
    assert torch.equal(torch.nonzero(p.t2d).flatten(), torch.arange(p.d2t.numel()) + p.d2t)


def test_remote_code_needs_trust_remote_code(tmp_path, kimi_model, capsys):
    rc = cli(["prepare", f"--run_dir={tmp_path}", f"--target.model={kimi_model}", "--prepare.max_conversations=3"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "--target.trust_remote_code=true" in err and str(kimi_model) in err


def test_tokenizer_hash_of_a_slow_tokenizer(kimi_model, kimi):
    cfg = TargetConfig(model=str(kimi_model), trust_remote_code=True)
    assert tokenizer_hash(load_tokenizer(cfg)) == tokenizer_hash(load_tokenizer(cfg)) == tokenizer_hash(kimi)
    other = load_tokenizer(TargetConfig(model=str(kimi_model), trust_remote_code=True, chat_template="{{ messages }}"))
    assert tokenizer_hash(other) != tokenizer_hash(kimi)


# ---- (d) a tokenizer whose tokens do not spell the text is refused -----------------------------


def test_tokens_that_do_not_spell_the_text_are_refused(tmp_path, kimi_dir):
    """<|im_end|> with lstrip (as some tokenizer configs set it): the slow tokenizer drops the spaces
    before it, so "Done!  " loses two bytes; eyas must refuse, not build a mask from wrong offsets."""
    import shutil

    from transformers import AutoTokenizer

    d = tmp_path / "lstrip"
    shutil.copytree(kimi_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    end_id = next(i for i, t in cfg["added_tokens_decoder"].items() if t["content"] == "<|im_end|>")
    cfg["added_tokens_decoder"][end_id]["lstrip"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(str(d), trust_remote_code=True)
    tokenize_conversations(tok, [HANDMADE[1]], 100_000, 1, Counter())  # no spaces before <|im_end|>: fine
    with pytest.raises(ConfigError) as e:
        tokenize_conversations(tok, [HANDMADE[0]], 100_000, 1, Counter())
    msg = str(e.value)
    assert str(d) in msg and "TikTokenTokenizer" in msg and "conversation multi" in msg
    assert "byte for byte" in msg and "fast tokenizer" in msg
