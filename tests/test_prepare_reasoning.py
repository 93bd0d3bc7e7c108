"""prepare on reasoning models' templates (Qwen3, Qwen3-Thinking-2507, Kimi-K2-Thinking, verbatim):
the reasoning is rendered by the template and masked in with the think markers the model writes,
only where the template shows it; what it cannot show is counted or, for the last turn, an error.

Independent of the implementation: the expected masked runs are written out by hand (reasoning,
markers, content, end token) and compared with the decoded runs of masked tokens."""

from __future__ import annotations

from collections import Counter

import pytest

from eyas.chat import Conversation
from eyas.errors import DataError
from eyas.prepare import drop_reasoning, tokenize_conversations
from tests.reasoning_templates import (
    KIMI_K2_THINKING_KEEP_TEMPLATE,
    KIMI_K2_THINKING_TEMPLATE,
    KIMI_SPECIALS,
    QWEN3_TEMPLATE,
    QWEN3_THINKING_2507_TEMPLATE,
    tokenizer_with,
)
from tests.test_prepare import HANDMADE, masked_runs


def a(content, reasoning=None):
    return {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}


def u(content):
    return {"role": "user", "content": content}


CONVS = [
    Conversation("two-turns", [u("What is 2+2?"), a("2+2 = 4.", "Two plus two.\nThat is 4."),
                               u("And times 3?"), a("(2+2)*3 = 12.", "4 times 3 is 12.")]),
    Conversation("system", [{"role": "system", "content": "Be terse."}, u("Say hi"), a("Hi", "A greeting: say hi.")]),
    Conversation("first-plain", [u("Name a colour."), a("Blue."), u("Another?"), a("Red 🟥.", "Not blue again: «red».")]),
    Conversation("last-plain", [u("Name a colour."), a("Blue.", "Any colour will do."), u("Another?"), a("Red.")]),
]


def runs(tok, convs, counts=None, texts=None):
    """Each conversation's masked runs; its tokens are the template's text (or `texts[id]`) tokenised as it is."""
    counts = Counter() if counts is None else counts
    ids, masks, kept = tokenize_conversations(tok, convs, 100_000, 64, counts)
    assert kept == [c.id for c in convs]
    for c, x in zip(convs, ids):
        text = (texts or {}).get(c.id) or tok.apply_chat_template(c.messages, tokenize=False)
        assert x == tok(text, add_special_tokens=False)["input_ids"]
    return {c.id: masked_runs(tok, x, m) for c, x, m in zip(convs, ids, masks)}


@pytest.mark.parametrize("think_special", [True, False])
def test_qwen3_masks_the_last_turns_thinking_block_with_its_markers(smollm2_tokenizer, think_special):
    tok = tokenizer_with(smollm2_tokenizer.name_or_path, QWEN3_TEMPLATE, [], think_special)
    counts = Counter()
    got = runs(tok, CONVS, counts)
    end = "<|im_end|>"
    assert got == {
        # the first answer is before the last user query: Qwen3 drops its reasoning, its content stays
        "two-turns": ["2+2 = 4." + end, "<think>\n4 times 3 is 12.\n</think>\n\n(2+2)*3 = 12." + end],
        "system": ["<think>\nA greeting: say hi.\n</think>\n\nHi" + end],
        "first-plain": ["Blue." + end, "<think>\nNot blue again: «red».\n</think>\n\nRed 🟥." + end],
        # no reasoning on the last turn: the empty think block is the template's, not masked
        "last-plain": ["Blue." + end, "Red." + end],
    }
    text = tok.apply_chat_template(CONVS[3].messages, tokenize=False)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nRed.<|im_end|>" in text
    assert counts["reasoning_not_rendered"] == 2  # two-turns' and last-plain's first answers


def test_qwen3_conversations_without_reasoning_mask_as_before(smollm2_tokenizer):
    tok = tokenizer_with(smollm2_tokenizer.name_or_path, QWEN3_TEMPLATE, [])
    got = runs(tok, HANDMADE)
    for conv in HANDMADE:
        assert got[conv.id] == [m["content"] + "<|im_end|>" for m in conv.messages if m["role"] == "assistant"]


def test_generation_prompt_that_opens_the_thinking_block_keeps_that_opener_unmasked(smollm2_tokenizer):
    """Qwen3-Thinking-2507: the prompt ends with '<think>\\n', so the model writes from the reasoning on."""
    tok = tokenizer_with(smollm2_tokenizer.name_or_path, QWEN3_THINKING_2507_TEMPLATE, [])
    got = runs(tok, CONVS[:2])
    assert got == {"two-turns": ["2+2 = 4.<|im_end|>", "4 times 3 is 12.\n</think>\n\n(2+2)*3 = 12.<|im_end|>"],
                   "system": ["A greeting: say hi.\n</think>\n\nHi<|im_end|>"]}


def test_kimi_k2_thinking_stock_template_gets_the_last_reasoning_written_into_its_empty_block(smollm2_tokenizer):
    """Kimi's stock template renders every turn of a conversation that ends on a plain answer as
    history (`<think></think>answer`); served, the model writes `<think>reasoning</think>answer` for
    the turn it answers: that is the last turn's training text, the earlier turns stay as rendered."""
    tok = tokenizer_with(smollm2_tokenizer.name_or_path, KIMI_K2_THINKING_TEMPLATE, KIMI_SPECIALS)
    text = tok.apply_chat_template(CONVS[0].messages, tokenize=False)
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think></think>(2+2)*3 = 12.<|im_end|>")
    # the expected texts, by hand: the stock rendering with the last reasoning between the empty block's tags
    filled = {}
    for c in CONVS:
        last = c.messages[-1]
        stock = tok.apply_chat_template(c.messages, tokenize=False)
        if "reasoning_content" in last:
            tail = "<think></think>" + last["content"] + "<|im_end|>"
            assert stock.endswith(tail)
            filled[c.id] = stock[: -len(tail)] + "<think>" + last["reasoning_content"] + "</think>" + last["content"] + "<|im_end|>"
    counts = Counter()
    got = runs(tok, CONVS, counts, filled)
    end = "<|im_end|>"
    assert got == {
        "two-turns": ["2+2 = 4." + end, "<think>4 times 3 is 12.</think>(2+2)*3 = 12." + end],
        "system": ["<think>A greeting: say hi.</think>Hi" + end],
        "first-plain": ["Blue." + end, "<think>Not blue again: «red».</think>Red 🟥." + end],
        "last-plain": ["Blue." + end, "Red." + end],
    }
    assert counts["reasoning_written_into_empty_block"] == 3
    assert counts["reasoning_not_rendered"] == 2  # two-turns' and last-plain's first turns: history
    ids, _, _ = tokenize_conversations(tok, CONVS[:1], 100_000, 8, Counter())
    assert tok.decode(ids[0]).endswith("<|im_middle|><think>4 times 3 is 12.</think>(2+2)*3 = 12.<|im_end|>")
    assert "<|im_middle|><think></think>2+2 = 4.<|im_end|>" in tok.decode(ids[0])
    # prepare.reasoning=drop: the answers alone, Kimi's empty think blocks unmasked
    convs = [Conversation(c.id, [dict(m) for m in c.messages]) for c in CONVS]
    assert drop_reasoning(convs) == 5
    assert runs(tok, convs) == {c.id: [m["content"] + "<|im_end|>" for m in c.messages if m["role"] == "assistant"]
                                for c in CONVS}


def test_a_template_without_the_last_reasoning_or_a_block_for_it_is_an_error(smollm2_tokenizer):
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    tok = tokenizer_with(smollm2_tokenizer.name_or_path, template, [])
    with pytest.raises(DataError, match=r"conversation two-turns: the chat template does not render the reasoning.*"
                                        r"--target.chat_template.*--prepare.reasoning=drop"):
        tokenize_conversations(tok, CONVS[:1], 100_000, 8, Counter())


def test_kimi_k2_thinking_template_that_keeps_reasoning_masks_think_tags(smollm2_tokenizer):
    """Kimi's generation prompt ends at <|im_middle|>: the model writes <think>, so it is masked in."""
    tok = tokenizer_with(smollm2_tokenizer.name_or_path, KIMI_K2_THINKING_KEEP_TEMPLATE, KIMI_SPECIALS)
    counts = Counter()
    got = runs(tok, CONVS, counts)
    end = "<|im_end|>"
    assert got == {
        "two-turns": ["<think>Two plus two.\nThat is 4.</think>2+2 = 4." + end, "<think>4 times 3 is 12.</think>(2+2)*3 = 12." + end],
        "system": ["<think>A greeting: say hi.</think>Hi" + end],
        "first-plain": ["Blue." + end, "<think>Not blue again: «red».</think>Red 🟥." + end],
        "last-plain": ["<think>Any colour will do.</think>Blue." + end, "Red." + end],
    }
    assert counts["reasoning_not_rendered"] == 0
    assert "<|im_middle|><think></think>Red.<|im_end|>" in tok.apply_chat_template(CONVS[3].messages, tokenize=False)


def test_reasoning_the_template_rewrites_is_an_error_naming_the_conversation(smollm2_tokenizer):
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
                "{{ m.reasoning_content | replace('\n', ' ') }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}")
    tok = tokenizer_with(smollm2_tokenizer.name_or_path, template, [])
    with pytest.raises(DataError, match="conversation two-turns: the chat template does not reproduce an assistant "
                                        "reasoning verbatim .*'Two plus two.\\\\nThat is 4.'"):
        tokenize_conversations(tok, CONVS[:1], 100_000, 8, Counter())
