"""Checks before the first stage of `eyas run`: what a later stage would refuse at its start,
refused before the earlier stages have spent their time."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from eyas.config import EyasConfig
from eyas.errors import ConfigError
from eyas.run.summary import record_failure

INPUTS_OUTSIDE = (("train", "init_from"), ("evaluate", "target_outputs"))
"""Paths a stage reads that must not lie in that stage's own directory (`eyas run` checks first)."""


def check_inputs_outside(cfg: EyasConfig, stages: list[str]) -> None:
    """A stage that runs replaces its directory, and an input there with it (INPUTS_OUTSIDE)."""
    for stage, key in INPUTS_OUTSIDE:
        given = getattr(getattr(cfg, stage), key)
        if stage in stages and given and Path(given).resolve().is_relative_to(cfg.stage_dir(stage).resolve()):
            raise ConfigError(f"--{stage}.{key}={given} lies inside this run's {stage} directory "
                              f"{cfg.stage_dir(stage).resolve()}, which the {stage} stage replaces when it runs: copy "
                              f"it elsewhere first, or give a new --run_dir")


def preflight(cfg: EyasConfig, stages: list[str]) -> None:
    """Before the first stage of `eyas run`: every check of the stages to run (`stages`) that needs
    only the config, the target's config.json (a multimodal wrapper's text config) and files the
    config names, so that a setting a later stage refuses at its start fails the run before the
    earlier stages have spent their time. A ConfigError naming the flag to change."""
    from eyas.capture import check_layer_ids, default_layer_ids
    from eyas.target import load_config as target_config

    _check_evaluate_bench(cfg, stages)
    _check_target_weights(cfg, stages)
    tc = cfg.target
    if tc.chat_template.endswith(".jinja") and not Path(tc.chat_template).is_file():  # as load_tokenizer says
        raise ConfigError(f"target.chat_template={tc.chat_template!r}: no such file")
    conf = target_config(tc)  # a local target.model that does not exist: "no such directory"
    vocab_size = int(conf.vocab_size)
    if "prepare" in stages and cfg.prepare.draft_vocab_size > vocab_size:
        raise ConfigError(f"prepare.draft_vocab_size={cfg.prepare.draft_vocab_size} is larger than the target "
                          f"vocabulary ({vocab_size}); use <= {vocab_size}")
    _check_evaluate_draft(cfg, stages)
    _check_vllm_evaluate(cfg, stages)
    if "extract" not in stages and "train" not in stages:
        return
    n = int(conf.num_hidden_layers)
    layer_ids = check_layer_ids(list(cfg.extract.layer_ids) or default_layer_ids(n), n)
    if "extract" in stages and cfg.extract.device_map and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("extract.device_map splits one target over the GPUs of one process; run it without torchrun")
    if "train" in stages:
        _check_draft_shape(cfg, conf, layer_ids)
    if "train" in stages and cfg.train.mode == "stream":  # vLLM, Ray, Mooncake here; the window's size
        from eyas.stream import check_stream

        check_stream(cfg, layer_ids, int(conf.hidden_size), int(os.environ.get("WORLD_SIZE", "1")), conf.model_type)


def _check_evaluate_bench(cfg: EyasConfig, stages: list[str]) -> None:
    """evaluate.bench read whole as evaluate reads it (each line a prompt, valid UTF-8), so that a
    missing file or a malformed line fails the run before prepare, extract and train, not after."""
    if "evaluate" in stages:
        from eyas.evaluate.inputs import load_bench

        load_bench(cfg.evaluate.bench, cfg.evaluate.num_questions)


def _check_target_weights(cfg: EyasConfig, stages: list[str]) -> None:
    """The target's weight files (their headers and sizes), where a stage of this run loads the
    target: a file cut short is named before prepare, not when extract loads it."""
    if any(s in stages for s in ("regenerate", "extract", "train", "evaluate")):
        from eyas.target import check_weight_files

        check_weight_files(cfg.target)


def _check_evaluate_draft(cfg: EyasConfig, stages: list[str]) -> None:
    """A draft named in evaluate.draft that is already there must fit the target (as evaluate checks
    at its start, whichever backend), before the stages ahead of evaluate run."""
    from eyas.draft_files import find
    from eyas.evaluate.decoding import check_draft_files_fit

    files = find(cfg.evaluate.draft) if "evaluate" in stages and cfg.evaluate.draft else None
    if files is not None:
        check_draft_files_fit(cfg, files)


def _check_vllm_evaluate(cfg: EyasConfig, stages: list[str]) -> None:
    """evaluate.backend=vllm: what that evaluator refuses at its start (no vLLM, an MLA target on
    vLLM's CPU build), refused before training, not after it."""
    if "evaluate" in stages and cfg.evaluate.backend == "vllm":
        from eyas.evaluate.vllm import check_supported

        check_supported(cfg)


def draft_shape(cfg: EyasConfig, target_conf, layer_ids: list[int]):
    """The DraftConfig train builds (eyas.train.build.draft_config) from the target's config and the
    train.* shape keys (its draft vocabulary size as prepare will choose it at most)."""
    from eyas.draft import DraftConfig

    vocab = cfg.prepare.draft_vocab_size or int(target_conf.vocab_size)
    return DraftConfig.from_target(target_conf, vocab, layer_ids, **cfg.train.draft_shape())


def _check_draft_shape(cfg: EyasConfig, target_conf, layer_ids: list[int]) -> None:
    """The draft's heads against its kv heads; train.init_from names a draft (its shape and vocabulary
    wait for prepare's vocabulary: `check_train_start`)."""
    tc = cfg.train
    dcfg = draft_shape(cfg, target_conf, layer_ids)
    if dcfg.num_attention_heads % dcfg.num_key_value_heads:
        raise ConfigError(
            f"draft heads {dcfg.num_attention_heads} are not a multiple of its kv heads {dcfg.num_key_value_heads} "
            f"(0 = the target's): change --train.num_attention_heads={tc.num_attention_heads} or "
            f"--train.num_key_value_heads={tc.num_key_value_heads}"
        )
    if tc.init_from and tc.resume in ("", "auto"):
        from eyas.train.init_from import init_files

        init_files(tc.init_from)  # "no such directory" / "not a draft directory"


def check_init_shape(cfg: EyasConfig) -> None:
    """train.init_from's draft against the shape this run trains (what train refuses only when it
    builds its draft, after extract); the draft vocabulary is `check_init_vocab`'s."""
    from eyas.capture import check_layer_ids, default_layer_ids
    from eyas.draft import SHAPE_FIELDS
    from eyas.draft_files import read_config
    from eyas.target import load_config as target_config
    from eyas.train.init_from import init_files

    tc = cfg.train
    conf = target_config(cfg.target)
    n = int(conf.num_hidden_layers)
    want = draft_shape(cfg, conf, check_layer_ids(list(cfg.extract.layer_ids) or default_layer_ids(n), n)).to_dict()
    have = read_config(init_files(tc.init_from)).to_dict()
    fields = [k for k in SHAPE_FIELDS if k != "draft_vocab_size"]
    diff = ", ".join(f"{k} {have[k]} there, {want[k]} here" for k in fields if have[k] != want[k])
    if diff:
        raise ConfigError(f"train.init_from={tc.init_from!r} is another draft shape ({diff}): set the --train.* shape "
                          "keys (intermediate_size, num_layers, heads) and --extract.layer_ids to the draft's, or "
                          "start without it")


def check_train_start(cfg: EyasConfig, configs: dict[str, EyasConfig], stages: list[str], run_dir: Path,
                      record: dict[str, Any]) -> None:
    """Before extract runs: what train would refuse only after it (its init_from draft's vocabulary
    against prepare's, then its shape), recorded as train's failure. Not when train does not run next, or resumes
    from a checkpoint the user named (init_from then goes unused)."""
    from eyas.train.init_from import check_init_vocab

    tc = configs["train"].train if "train" in stages else None
    if tc is None or tc.resume not in ("", "auto"):  # (also with --stop_after=extract: train follows later)
        return
    try:
        check_init_vocab(tc, configs["train"].stage_dir("prepare"))
        if tc.init_from:
            check_init_shape(configs["train"])
    except BaseException as e:
        print("[eyas:run] train: refused before extract runs", file=sys.stderr, flush=True)
        record_failure(cfg, run_dir, record, "train", cfg.stage_dir("train"), e, 0.0, time.time())
        raise
