"""Everything the loop needs, built from the config: data, target tensors, draft, optimizer.

Legend: V target vocab, W draft vocab, D hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas import vocab
from eyas.artifacts import hash_json
from eyas.config import EyasConfig
from eyas.draft import DraftConfig, Eagle3Draft, init_flex_attention
from eyas.errors import ArtifactError, ConfigError
from eyas.train.data import OnlineStates, split_groups, split_indices
from eyas.train.loop import Teacher, Trainer, lr_lambda
from eyas.train import resume
from eyas.train.init_from import init_weights
from eyas.train.parallel import parallelize
from eyas.ttt import TTTDraft, resolve_attention

DEVICE_MAPS = ("auto", "balanced", "sequential")


@dataclass
class TrainData:
    """The samples and the target-side tensors, offline or online."""

    source: Any  # HiddenStates, Prepared (online) or any indexable with .lengths
    d2t: torch.Tensor
    t2d: torch.Tensor
    layer_ids: list[int]
    embed_VD: torch.Tensor
    lm_head_VD: torch.Tensor
    target_config: Any  # the target's HF (text) config
    states: OnlineStates | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    groups: list[int] | None = None  # held-out split groups per source sample (split_groups); None: per sample

    @property
    def lengths(self) -> torch.Tensor:
        return torch.as_tensor(self.source.lengths, dtype=torch.long)


def load_data(cfg: EyasConfig, device: torch.device) -> TrainData:
    from eyas.prepared import Prepared
    from eyas.target import load_config, resolve_dtype

    tc = cfg.train
    prep = Prepared(cfg.stage_dir("prepare"))
    tcfg = load_config(cfg.target)
    if prep.t2d.numel() != tcfg.vocab_size:
        raise ArtifactError(
            f"{prep.dir} was prepared for a vocabulary of {prep.t2d.numel()} tokens, target.model={cfg.target.model!r} "
            f"has {tcfg.vocab_size}: re-run `eyas prepare` for this target"
        )
    inputs: dict[str, Any] = {"prepare": {"dir": str(prep.dir), "meta_sha256": hash_json(prep.meta)}}
    dtype = resolve_dtype(cfg.target.dtype, str(device))
    if tc.mode == "offline":
        from eyas.hidden_states import HiddenStates
        from eyas.train.target_weights import load_embed_and_head

        hs = HiddenStates(cfg.stage_dir("extract"))
        if hs.hidden_size != tcfg.hidden_size:
            raise ArtifactError(
                f"{hs.dir} holds hidden states of width {hs.hidden_size}, target.model={cfg.target.model!r} has "
                f"hidden size {tcfg.hidden_size}: re-run `eyas extract` for this target"
            )
        inputs["extract"] = {"dir": str(hs.dir), "meta_sha256": hash_json(hs.meta)}
        embed, head = load_embed_and_head(cfg.target)
        return TrainData(hs, prep.d2t, prep.t2d, list(hs.layer_ids), embed.to(dtype), head.to(dtype), tcfg, None, inputs,
                         split_groups_of(prep, hs.indices, hs.ids))
    from eyas.capture import check_layer_ids, default_layer_ids
    from eyas.target import load_model

    n = tcfg.num_hidden_layers  # checked before the target loads; extract.layer_ids is the one aux-layer key
    layer_ids = check_layer_ids(list(cfg.extract.layer_ids) or default_layer_ids(n), n)
    if tc.mode == "stream":  # the engines capture the states (eyas.stream, started by train once the schedule is known)
        from eyas.train.target_weights import load_embed_and_head

        embed, head = load_embed_and_head(cfg.target)
        inputs["stream"] = {"layer_ids": layer_ids, "engines": tc.stream.engines}
        return TrainData(prep, prep.d2t, prep.t2d, layer_ids, embed.to(dtype), head.to(dtype), tcfg, None, inputs,
                         split_groups_of(prep))
    if tc.target_device in DEVICE_MAPS:  # the target spread over this process's visible GPUs
        model = load_model(cfg.target, device_map=tc.target_device)
    else:
        model = load_model(cfg.target, device=torch.device(tc.target_device) if tc.target_device else device)
    target_device = model.get_input_embeddings().weight.device
    embed = model.get_input_embeddings().weight.detach()
    out = model.get_output_embeddings()
    head = out.weight.detach() if out is not None else embed
    return TrainData(prep, prep.d2t, prep.t2d, layer_ids, embed, head, tcfg,
                     OnlineStates(model, layer_ids, target_device, group_overhead_tokens=tc.target_group_tokens or None),
                     inputs, split_groups_of(prep))


def split_groups_of(prep, source_indices: list[int] | None = None, source_ids: list[str] | None = None) -> list[int]:
    """`split_groups` of the source samples: all of prepare's (online), or those an extract output
    holds (`source_indices` into prepare's samples, with their ids to check they are the same)."""
    keys = prep.prompt_keys()
    if source_indices is None:
        return split_groups(prep.ids, keys)
    bad = [k for k, (i, x) in enumerate(zip(source_indices, source_ids)) if i >= len(prep.ids) or prep.ids[i] != x]
    if bad:
        k = bad[0]
        raise ArtifactError(f"the extract output's sample {k} ({source_ids[k]!r}, prepare index {source_indices[k]}) is not "
                            f"that sample of {prep.dir} ({len(bad)} such): re-run `eyas extract` on this prepare output")
    return split_groups(list(source_ids), [keys[i] for i in source_indices])


def draft_config(cfg: EyasConfig, data: TrainData) -> DraftConfig:
    dcfg = DraftConfig.from_target(data.target_config, int(data.d2t.numel()), data.layer_ids, **cfg.train.draft_shape())
    if dcfg.num_attention_heads % dcfg.num_key_value_heads:
        raise ConfigError(
            f"draft heads {dcfg.num_attention_heads} are not a multiple of its kv heads {dcfg.num_key_value_heads}: "
            "change --train.num_attention_heads or --train.num_key_value_heads"
        )
    if tuple(data.embed_VD.shape) != (dcfg.vocab_size, dcfg.hidden_size):
        raise ArtifactError(
            f"the target's input embedding is {tuple(data.embed_VD.shape)}, its config says vocab {dcfg.vocab_size} x "
            f"hidden {dcfg.hidden_size}; eyas needs them to agree (the draft reads that embedding)"
        )
    return dcfg


def verify_shards(source, rank: int, world_size: int, device: torch.device) -> None:
    """Offline: check every extract shard's sha256 once, before any DataLoader worker exists, each
    rank a disjoint share, in threads. Checked on first read instead, every worker of every epoch
    (and of every held-out evaluation) re-hashed the shards it touched: tens of seconds per epoch
    and per evaluation with SmolLM2's 41 GB of states on one H200."""
    from eyas.distributed import all_reduce_max
    from eyas.hidden_states import HiddenStates

    if not isinstance(source, HiddenStates) or not source.verify_checksums:
        return
    t0, mine, err = time.perf_counter(), range(rank, len(source.shards), world_size), None
    try:
        nbytes = source.verify(mine)
    except Exception as e:  # any failure (corrupt shard, I/O error) reaches the collective, then is raised
        err, nbytes = e, 0
    if all_reduce_max(float(err is not None), device):
        if err is not None:
            raise err
        raise ArtifactError("an extract shard failed its check on another rank (that rank's error names it)")
    source.mark_verified(range(len(source.shards)))
    if rank == 0:
        print(f"[eyas:train] checked the sha256 of {len(mine)} of {len(source.shards)} extract shards on this rank "
              f"({nbytes / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)


def build_trainer(
    cfg: EyasConfig, data: TrainData, device: torch.device, rank: int = 0, world_size: int = 1, total_steps: int = 1,
    init: bool = True,
) -> tuple[Trainer, DraftConfig]:
    """`init`: apply --train.init_from or --train.init_head (off when a checkpoint is resumed: it
    holds the weights)."""
    tc = cfg.train
    dcfg = draft_config(cfg, data)
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank
    draft = Eagle3Draft(dcfg, data.embed_VD)
    draft.set_vocab(data.d2t, data.t2d)
    record = None
    if init and tc.init_from:
        record = init_weights(draft, tc.init_from, data.d2t, data.t2d, data.lm_head_VD, tc.init_vocab == "remap")
        if rank == 0:
            remapped = (f"; draft vocabulary remapped: {record['vocab']['copied']:,} lm_head rows copied, "
                        f"{record['vocab']['new']:,} new (the target's rows through a least-squares map)"
                        if "vocab" in record else "")
            print(f"[eyas:train] weights from {tc.init_from} (sha256 {record['weights_sha256'][:12]}){remapped}; "
                  "optimizer and learning-rate schedule start afresh", flush=True)
    elif init and tc.init_head == "target":
        with torch.no_grad():
            # the target's directions at the default initialisation's scale: its own rows (row norm
            # ~3.2 for SmolLM2 against ~0.58) made the first logits confident and trained worse (docs/benchmarks.md)
            rows_WD = vocab.target_head_rows(data.lm_head_VD, data.d2t)
            rows_WD *= draft.lm_head.weight.norm(dim=1).mean() / rows_WD.norm(dim=1).mean()
            draft.lm_head.weight.copy_(rows_WD)
        if rank == 0:
            print(f"[eyas:train] lm_head from the target's rows of the {data.d2t.numel():,} draft tokens, "
                  "scaled to the default initialisation's mean row norm (train.init_head=target)", flush=True)
    if init and not tc.init_from and tc.align_top_k and rank == 0:
        print(f"[eyas:train] warning: train.align_top_k={tc.align_top_k} on a draft from random weights: until its "
              f"{tc.align_top_k} best often hold the target's token, the TTT steps after the first train on few "
              "positions (trained_share_T); from scratch it trained slower than without the mask "
              "(docs/benchmarks.md): start it on a trained draft (--train.init_from)", flush=True)
    draft.to(device)
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")
    attention = resolve_attention(tc.attention, device)
    if tc.compile or attention == "flex":  # 7 TTT steps x a few shapes each: more than dynamo's default 8
        import torch._dynamo as dynamo

        dynamo.config.recompile_limit = max(64, dynamo.config.recompile_limit)
    if attention == "flex":
        init_flex_attention()
    if tc.compile:
        draft.forward_step = torch.compile(draft.forward_step)
    model = parallelize(TTTDraft(draft), "fsdp" if tc.parallel == "fsdp" else "ddp", world_size, device, bf16)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=tc.lr, betas=tuple(tc.betas),
        weight_decay=tc.weight_decay, fused=device.type == "cuda",
    )
    warmup = resume.warmup_steps(tc, total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, warmup, tc.min_lr_ratio))
    d2t, t2d = data.d2t.to(device), data.t2d.to(device)
    teacher = Teacher(
        lm_head_VD=data.lm_head_VD.to(device),
        draft_ids_W=torch.arange(d2t.numel(), device=device) + d2t,
        target_to_draft_V=vocab.target_to_draft(torch.arange(t2d.numel(), device=device), t2d),
        chunk=tc.teacher_chunk,
    )
    tr = Trainer(
        tc=tc, model=model, draft=draft, optimizer=optimizer, scheduler=scheduler, teacher=teacher, device=device,
        autocast_dtype=torch.bfloat16 if bf16 else None, attention=attention,
        world_size=world_size, rank=rank, states=data.states, init_from=record,
    )
    return tr, dcfg


def splits(cfg: EyasConfig, data: TrainData, rank: int = 0) -> tuple[list[int], list[int]]:
    return split_indices(len(data.source), cfg.train.eval_fraction, cfg.seed, data.groups, say=rank == 0)


def stage_dirs(cfg: EyasConfig) -> tuple[Path, Path]:
    out = cfg.stage_dir("train")
    return out, out / "checkpoints"
