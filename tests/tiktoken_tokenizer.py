"""A tiny tokenizer in Kimi-K2 / K2.5's own form: tiktoken BPE, remote code, a slow (Python) tokenizer.

    write_kimi_tokenizer(dir) -> dir    # tiktoken.model, tokenization_kimi.py, tokenizer_config.json,
                                        # chat_template.jinja; VOCAB_SIZE ids in all
    AutoTokenizer.from_pretrained(dir, trust_remote_code=True)   # -> TikTokenTokenizer, is_fast False

* `tiktoken.model`: a real byte-level BPE of BASE_VOCAB ranks (the 256 bytes, then merges), learned
  in milliseconds by the `tokenizers` BPE trainer on TRAINING_TEXT (English, German, French,
  Russian, Chinese, Japanese, Korean, emoji, code) and written as tiktoken reads it: one
  `base64(token bytes) rank` per line. The 256 special ids follow it, as in Kimi
  (BASE_VOCAB + 256 = VOCAB_SIZE, like Kimi's 163584 + 256 = 163840).
* `tokenization_kimi.py`: Moonshot's TikTokenTokenizer (KIMI_TOKENIZER_PY, source below).
* `chat_template.jinja`: Kimi-K2.5's chat template (KIMI_K25_CHAT_TEMPLATE, source below).
* `tokenizer_config.json`: Kimi's auto_map, special tokens and ids (SPECIAL_TOKENS).

Needs `tiktoken` (the test extra in pyproject.toml). The result is the same on every call.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

BASE_VOCAB = 1792
"""Ranks in tiktoken.model (256 bytes + 1536 merges)."""
NUM_RESERVED_SPECIAL = 256
"""Special ids after the ranks, as TikTokenTokenizer.num_reserved_special_tokens."""
VOCAB_SIZE = BASE_VOCAB + NUM_RESERVED_SPECIAL
"""2048: the tokenizer's ids; a model using it needs vocab_size >= VOCAB_SIZE."""

# Kimi's named special tokens, by offset from the first special id (Kimi-K2: [BOS] = 163584 =
# offset 0, [EOS] 163585, <|im_end|> 163586, [EOT] 163593, <|im_middle|> 163601, [PAD] 163839, ...);
# the others are <|reserved_token_{id}|>, as tokenization_kimi.py names them.
SPECIAL_TOKENS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>",
    20: "<|media_end|>", 21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}  # fmt: skip

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. Speculative decoding lets a small draft model propose
several tokens that the large target model verifies in one forward pass; when the draft is right,
generation is faster and the output is exactly what the target alone would have produced.
A tokenizer splits text into pieces: words, parts of words, punctuation, numbers and whitespace.
Byte-level BPE starts from the 256 bytes and repeatedly merges the most frequent adjacent pair,
so every string can be encoded, including emoji and scripts the training data rarely contained.
Training a draft needs the target's hidden states, the token ids and a loss mask that selects the
assistant's answers; the user's questions and the system prompt are context, not targets.
Please write a function that returns the sum of the squares of the even numbers in a list.
Sure! Here is one way to do it, with a short explanation of each step and an example call.
What is the capital of France? The capital of France is Paris, which lies on the Seine river.
How many days are there in a leap year? There are 366 days in a leap year and 365 in other years.
Summarize the following paragraph in two sentences, keeping the names and the numbers intact.
Translate into German: "The weather is nice today, let's go for a walk in the park."
Das Wetter ist heute schön, lass uns im Park spazieren gehen. Übersetze bitte auch diesen Satz:
Größere Modelle brauchen mehr Speicher, aber die Entwürfe sind klein und schnell zu trainieren.
Le renard brun rapide saute par-dessus le chien paresseux. Où est la bibliothèque ? Ça va très bien,
merci beaucoup ! L'été dernier, nous sommes allés à la mer et nous avons mangé des crêpes.
El zorro marrón salta sobre el perro perezoso. ¿Dónde está la estación? Mañana será otro día.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела? Спасибо, всё хорошо.
敏捷的棕色狐狸跳过了懒狗。今天天气很好，我们去公园散步吧。请把这句话翻译成英文。
机器学习模型需要大量的数据和计算资源。中文字符在UTF-8中占用三个字节。谢谢你的帮助！
素早い茶色の狐がのろまな犬を飛び越える。今日はいい天気ですね。ありがとうございます。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요, 만나서 반갑습니다. 감사합니다!
Emoji: 🐈 🐕 🚀 ✨ 👍 😀 😂 🎉 ❤️ 🔥 ✅ — «quotes», “curly quotes”, ‘single’, ellipsis… and dashes – —.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 65536 3.14159 2.71828 1e-5 -7 +12 50% $19.99 €5.
```python
def sum_even_squares(numbers: list[int]) -> int:
    \"\"\"Return the sum of the squares of the even numbers.\"\"\"
    total = 0
    for n in numbers:
        if n % 2 == 0:
            total += n * n
    return total


print(sum_even_squares([1, 2, 3, 4]))  # 20
```
```bash
pip install --upgrade tiktoken && python -m pytest -q tests/ --maxfail=1
for f in *.jsonl; do wc -l "$f"; done
```
{"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi there!"}]}
<html><body><h1>Title</h1><p class="note">A paragraph &amp; a <a href="https://example.com">link</a>.</p></body></html>
SELECT name, COUNT(*) AS n FROM users WHERE age >= 18 GROUP BY name ORDER BY n DESC LIMIT 10;
Mathematics: the derivative of x^2 is 2x; the integral of 1/x is ln|x| + C; e^(iπ) + 1 = 0.
Physics describes energy, momentum, waves, particles, fields, gravity, light, heat and motion.
History remembers kingdoms, empires, revolutions, inventions, explorers, wars, treaties, and peace.
Cooking: whisk the eggs, melt the butter, add flour and sugar, bake at 180 degrees for 25 minutes.
Weather forecast: cloudy in the morning, sunny afternoon, light rain expected during the evening.
Dear team, thank you for your hard work this quarter; the release shipped on time and users love it.
Questions? Answers! Reasons; results: conclusions... (parentheses) [brackets] {braces} <angles>
"""


def _train_ranks() -> dict[bytes, int]:
    """BASE_VOCAB tiktoken ranks: bytes 0..255 first, then the trainer's merges in the order learned."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB, min_frequency=1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        token = bytes(byte_of[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    assert len(ranks) == BASE_VOCAB, f"TRAINING_TEXT gave {len(ranks)} ranks, not {BASE_VOCAB}"
    return ranks


def special_tokens() -> dict[int, str]:
    """Every special id -> its text (the named ones and the reserved ones), as tokenization_kimi.py makes them."""
    return {BASE_VOCAB + k: SPECIAL_TOKENS.get(k, f"<|reserved_token_{BASE_VOCAB + k}|>") for k in range(NUM_RESERVED_SPECIAL)}


def tokenizer_config() -> dict:
    """tokenizer_config.json in Kimi-K2's form."""
    added = {
        str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, text in special_tokens().items()
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }  # fmt: skip


def write_kimi_tokenizer(dir: Path) -> Path:
    """Write the tokenizer files into `dir` (created if needed); returns `dir`."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    ranks = _train_ranks()
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    (dir / "tiktoken.model").write_text("".join(lines), encoding="utf-8")
    (dir / "tokenization_kimi.py").write_text(KIMI_TOKENIZER_PY, encoding="utf-8")
    (dir / "chat_template.jinja").write_text(KIMI_K25_CHAT_TEMPLATE, encoding="utf-8")
    (dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    return dir


# Moonshot's tokenization_kimi.py (the TikTokenTokenizer of moonshotai/Kimi-K2-Instruct, -K2-Thinking and
# -K2.5 on the Hugging Face hub), copied from the mirror in github.com/troy12x/quasar-kimi
# (tokenization_kimi.py @ d47b0df) with the two changes Moonshot's later revisions carry (as in
# github.com/PabloRaka/bear tokenization_kimi.py @ 2a0c50d): `bytes_to_unicode` imported from
# transformers.convert_slow_tokenizer (transformers 5 removed it from tokenization_gpt2), and
# `added_tokens_decoder` optional and passed on to PreTrainedTokenizer; the special ids span
# num_reserved_special_tokens exactly. Formatting and code otherwise as Moonshot ships it.
KIMI_TOKENIZER_PY = r'''import os
import tiktoken

from logging import getLogger
from pathlib import Path
from typing import (
    cast,
    Tuple,
    Dict,
    Iterator,
    List,
    Union,
    Optional,
)
from shutil import copyfile
from tiktoken.load import load_tiktoken_bpe
from tokenizers import AddedToken, pre_tokenizers, Regex
from transformers.tokenization_utils import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode
from typing import Any


logger = getLogger(__name__)
VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}


class TikTokenTokenizer(PreTrainedTokenizer):
    """
    Tokenizing and encoding/decoding text using the Tiktoken tokenizer. See megatron/tokenizer/tiktoken_tokenizer.py.

    This tokenizer inherits from [`PreTrainedTokenizer`] which contains most of the main methods. Users should refer to
    this superclass for more information regarding those methods.

    Args:
        vocab_file (`str`):
            The path to the Tiktoken model file.
        bos_token (`str` or `tokenizers.AddedToken`, *optional*, defaults to `"<|begin_of_text|>",`):
            The beginning of sequence token that was used during pretraining. Can be used a sequence classifier token.
        eos_token (`str` or `tokenizers.AddedToken`, *optional*, defaults to `"<|end_of_text|>"`):
            The end of sequence token.
        unk_token (`str` or `tokenizers.AddedToken`, *optional*, defaults to `"<|reserved_special_token_249|>"`):
            The unknown token. A token that is not in the vocabulary cannot be converted to an ID and is set to be this
            token instead. The second to last item in special_tokens.
        pad_token (`str` or `tokenizers.AddedToken`, *optional*, defaults to `"<|reserved_special_token_250|>"`):
            The token used for padding, for example when batching sequences of different lengths.
        additional_special_tokens (list of `str`, *optional*):
            A tuple or a list of additional tokens, which will be marked as `special`, meaning that they will be
            skipped when decoding if `skip_special_tokens` is set to `True`.
    """

    vocab_files_names = VOCAB_FILES_NAMES

    model_input_names = ["input_ids", "attention_mask"]

    special_tokens: Dict[str, int]

    num_reserved_special_tokens = 256

    pat_str = "|".join(
        [
            r"""[\p{Han}]+""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    )

    def __init__(
        self,
        vocab_file,
        bos_token: Union[str, AddedToken]="[BOS]",
        eos_token: Union[str, AddedToken]="[EOS]",
        unk_token: Union[str, AddedToken, None]=None,
        pad_token: Union[str, AddedToken, None]=None,
        additional_special_tokens: List[str]=None,
        added_tokens_decoder: Optional[dict] = None,
        **kwargs,
    ):
        assert os.path.isfile(vocab_file), vocab_file

        if additional_special_tokens is None:
            additional_special_tokens  = [
                "<|im_end|>",
                "<|im_user|>",
                "<|im_assistant|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "[EOT]",
                "<|im_system|>",
                "<|im_middle|>",
            ]

        if added_tokens_decoder:
            special_tokens_mapping = {
                i: added_tokens_decoder[i].content for i in added_tokens_decoder
            }
        else:
            special_tokens_mapping = {}

        self.vocab_file = vocab_file
        mergeable_ranks = load_tiktoken_bpe(vocab_file)
        num_base_tokens = len(mergeable_ranks)
        self.special_tokens = {
            special_tokens_mapping.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(
                num_base_tokens, num_base_tokens + self.num_reserved_special_tokens
            )
        }



        self.model = tiktoken.Encoding(
            name=Path(vocab_file).name,
            pat_str=self.pat_str,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        logger.info(f"Reloaded tiktoken model from {vocab_file}")

        self.n_words: int = self.model.n_vocab
        # BOS / EOS token IDs
        self.bos_id: int = self.special_tokens[str(bos_token)]
        self.eos_id: int = self.special_tokens[str(eos_token)]
        logger.info(
            f"#words: {self.n_words} - BOS ID: {self.bos_id} - EOS ID: {self.eos_id}"
        )

        self.pad_id: int = self.special_tokens[str(pad_token)]
        self.unk_id: int = self.special_tokens[str(unk_token)]

        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}

        self.decoder = {}
        for i in range(self.n_words):
            # Taken from https://gist.github.com/xenova/a452a6474428de0182b17605a98631ee
            decoding = ''.join([
                self.byte_encoder[ord(char)] for char in
                self.model.decode_single_token_bytes(i).decode('latin-1')
            ])
            self.decoder[i] = decoding

        self.encoder = {}
        for i in range(self.n_words):
            if i in self.decoder:
                self.encoder[self.decoder[i]] = i

        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            additional_special_tokens=additional_special_tokens,
            added_tokens_decoder=added_tokens_decoder,
            **kwargs,
        )
        self.all_special_ids_set = set(self.all_special_ids)

    def encode(
        self,
        text: str,
        allow_special_tokens: bool = True,
        **kwargs
    ) -> List[int]:
        """
        Encodes a string into a list of token IDs.

        Args:
            text (str): The input string to be encoded.

        Returns:
            list[int]: A list of token IDs.
        """
        # If there are other args, we should call super().encode because there are a lot of code
        # to handle those args. supper().encode finally will call _tokenize and _convert_token_to_id.
        # NOTE: our encode method is not compatible with the super().encode method,
        #   e.g. split_special_tokens' default is True in our encode method.
        if len(kwargs) > 0:
            return super().encode(text, **kwargs)

        assert type(text) is str

        # The tiktoken tokenizer can handle <=400k chars without
        # pyo3_runtime.PanicException.
        TIKTOKEN_MAX_ENCODE_CHARS = 400_000

        # https://github.com/openai/tiktoken/issues/195
        # Here we iterate over subsequences and split if we exceed the limit
        # of max consecutive non-whitespace or whitespace characters.
        MAX_NO_WHITESPACES_CHARS = 25_000

        texts = self.pre_tokenizer_process(text)

        all_substrs = []
        for text in texts:
            substrs = (
                substr
                for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS)
                for substr in self._split_whitespaces_or_nonwhitespaces(
                    text[i: i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS
                )
            )
            all_substrs.extend(substrs)

        t: List[int] = []
        for substr in all_substrs:
            if allow_special_tokens:
                t.extend(
                    # we should consider special token as a common token
                    self.model.encode(
                        substr,
                        allowed_special="all",
                    )
                )
            else:
                t.extend(
                    # we should consider special token as a common token
                    self.model.encode(
                        substr,
                        disallowed_special=(),
                    )
                )

        return t

    def decode(
        self,
        token_ids: Union[int, List[int]],
        **kwargs
    ) -> str:
        """
        Decodes a list of token IDs into a string.

        Args:
            token_ids (List[int]): The list of token IDs to be decoded.

        Returns:
            str: The decoded string.
        """
        # If there are other args, we should call super().decode because there are a lot of code
        # to handle those args. supper().encode finally will call convert_tokens_to_string and _convert_id_to_token.
        if len(kwargs) > 0:
            return super().decode(token_ids, **kwargs)

        if type(token_ids) is int:
            token_ids = [token_ids]

        return self.model.decode(cast(List[int], token_ids))

    @staticmethod
    def _split_whitespaces_or_nonwhitespaces(
        s: str, max_consecutive_slice_len: int
    ) -> Iterator[str]:
        """
        Splits the string `s` so that each substring contains no more than `max_consecutive_slice_len`
        consecutive whitespaces or consecutive non-whitespaces.
        """
        current_slice_len = 0
        current_slice_is_space = s[0].isspace() if len(s) > 0 else False
        slice_start = 0

        for i in range(len(s)):
            is_now_space = s[i].isspace()

            if current_slice_is_space ^ is_now_space:
                current_slice_len = 1
                current_slice_is_space = is_now_space
            else:
                current_slice_len += 1
                if current_slice_len > max_consecutive_slice_len:
                    yield s[slice_start:i]
                    slice_start = i
                    current_slice_len = 1
        yield s[slice_start:]

    def pre_tokenizer_process(self, text: str) -> List[str]:
        """
        pre-tokenizes the input text into a list of tokens.
        This method is used to split the input text into smaller chunks for internal processing.
        """
        return [text]


    """ ----- Below are the abstract methods required by PreTrainedTokenizer ----- """
    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> Dict[str, int]:
        return self.encoder

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        return [
            self.decoder[t]
            for t in self.encode(text)
        ]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.unk_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index)

    @staticmethod
    def clean_up_tokenization(out_string: str) -> str:
        return out_string

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        text = ''.join(tokens)
        text = bytearray([self.byte_decoder[c] for c in text]).decode('utf-8', 'replace')
        return text

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None) -> Tuple[str]:
        if not os.path.isdir(save_directory):
            raise ValueError(f"vocabulary path ({save_directory}) should be a directory")
        out_vocab_file = os.path.join(
            save_directory, (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        )

        if os.path.abspath(self.vocab_file) != os.path.abspath(out_vocab_file) and os.path.isfile(self.vocab_file):
            copyfile(self.vocab_file, out_vocab_file)

        return (out_vocab_file,)



    def apply_chat_template(
        self, conversation, tools: Optional[list[dict]] = None,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        **kwargs
    ):
        tools = deep_sort_dict(tools)
        return super().apply_chat_template(conversation,
                                           tools=tools,
                                           tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt,
                                           **kwargs)


def deep_sort_dict(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: deep_sort_dict(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort_dict(item) for item in obj]
    return obj
'''


# Kimi-K2.5's chat_template.jinja (moonshotai/Kimi-K2.5 on the Hugging Face hub), from the copy in
# github.com/radixark/miles, miles/utils/chat_template_utils/templates/kimi_k25_fixed.jinja @ cbe1940
# ("[TITO] model support for Kimi-k2/2.5/2.6"), with miles' one patch undone: miles wraps the search
# for the last non-tool-call assistant message in `{%- if not preserve_thinking -%}` (and sets
# preserve_thinking); Moonshot's template runs it always, as Kimi-K2-Thinking's does
# (huggingface.co/moonshotai/Kimi-K2-Thinking/blob/main/chat_template.jinja). Everything else verbatim.
# Every assistant turn up to the last non-tool-call one renders as `<think></think>{content}<|im_end|>`.
KIMI_K25_CHAT_TEMPLATE = """\
{%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
      {{ c }}
    {%- elif c is not none -%}
      {% for content in c -%}
        {% if content['type'] == 'image' or content['type'] == 'image_url' -%}
          <|media_begin|>image<|media_content|><|media_pad|><|media_end|>
        {% elif content['type'] == 'video' or content['type']== 'video_url'-%}
          <|kimi_k25_video_placeholder|>
        {% else -%}
          {{ content['text'] }}
        {%- endif -%}
      {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{% macro set_roles(message) -%}
  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}
{%- endmacro -%}


{%- macro render_toolcalls(message) -%}
  <|tool_calls_section_begin|>
  {%- for tool_call in message['tool_calls'] -%}
    {%- set formatted_id = tool_call['id'] -%}
    <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}


{# Find last non-tool-call assisitant message #}
{%- set ns = namespace(last_non_tool_call_assistant_msg=-1) -%}
{%- for idx in range(messages|length-1, -1, -1) -%}
    {%- if messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') -%}
        {%- set ns.last_non_tool_call_assistant_msg = idx -%}
        {%- break -%}
    {%- endif -%}
{%- endfor -%}

{# split all messages into history & suffix, reasoning_content in suffix should be reserved.#}
{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1] -%}
{%- set suffix_msgs = messages[ns.last_non_tool_call_assistant_msg+1:] -%}

{%- if tools -%}
  {%- if tools_ts_str -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools_ts_str }}<|im_end|>
  {%- else -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
  {%- endif -%}
{%- endif -%}

{%- for message in hist_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    <think></think>{{render_content(message)}}
    {%- if message.get('tool_calls') -%}
      {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}

{%- for message in suffix_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    {%- if thinking is defined and thinking is false -%}
    <think></think>{{render_content(message)}}
    {%- else -%}
    {%- set rc = message.get('reasoning_content', '') -%}
    <think>{{rc}}</think>{{render_content(message)}}
    {%- endif -%}
    {%- if message.get('tool_calls') -%}
     {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}


{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}
  <think></think>
  {%- else -%}
  <think>
  {%- endif -%}
{%- endif -%}
"""
