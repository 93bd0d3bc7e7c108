"""train.init_from: start a training from a trained draft of any on-disk form (eyas.draft_files).

Checked before anything expensive (`eyas run` before extract, train before it loads the data):
the directory holds a draft (`init_files`), made for this target's vocabulary, with this run's
draft vocabulary unless train.init_vocab=remap carries its lm_head rows over by token
(`check_init_vocab`). `init_weights` then copies it into the freshly built draft.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eyas.config import TrainConfig
from eyas.draft import SHAPE_FIELDS, Eagle3Draft
from eyas.draft_files import DraftFiles, locate, open_draft, read_config, read_vocab
from eyas.errors import ArtifactError, ConfigError
from eyas.vocab import remap_head


def init_files(path: str) -> DraftFiles:
    """train.init_from -> the draft it names (a checkpoint, an exported layout or an export root)."""
    return locate(path, "train.init_from", ConfigError)


def is_same_vocab(src_d2t: torch.Tensor, src_t2d: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> bool:
    return src_d2t.shape == d2t.shape and src_t2d.shape == t2d.shape and torch.equal(
        src_d2t, d2t.to(src_d2t.device)) and torch.equal(src_t2d, t2d.to(src_t2d.device))


def other_vocab(path: str, src_d2t: torch.Tensor, d2t: torch.Tensor) -> ArtifactError:
    theirs = set((torch.arange(src_d2t.numel()) + src_d2t.cpu()).tolist())
    missing = sum(1 for i in (torch.arange(d2t.numel()) + d2t.cpu()).tolist() if i not in theirs)
    return ArtifactError(f"train.init_from={path!r} has another draft vocabulary than this run's prepare stage "
                         f"(d2t/t2d: {missing} of the {d2t.numel()} draft tokens here are not among its "
                         f"{src_d2t.numel()}): prepare with the draft_vocab_size and data it was trained on, start "
                         "without it, or pass --train.init_vocab=remap to carry its lm_head rows over by token")


def check_init_vocab(tc: TrainConfig, prepare_dir: Path) -> None:
    """train.init_from's draft vocabulary against prepare's (its vocab.safetensors) unless
    train.init_vocab=remap maps one onto the other; read without building the draft (whose
    embedding would be the target's V x D). A draft for a target of another vocabulary is refused
    even with remap: nothing carries it over."""
    from safetensors.torch import load_file

    if not tc.init_from:
        return
    files = init_files(tc.init_from)
    v = load_file(str(Path(prepare_dir) / "vocab.safetensors"))
    src_d2t, src_t2d = read_vocab(files)
    vocab_size = read_config(files).vocab_size
    if vocab_size != v["t2d"].numel():
        raise ConfigError(f"train.init_from={tc.init_from!r} is a draft for another target (vocab_size {vocab_size} "
                          f"there, {v['t2d'].numel()} here): start without it")
    if tc.init_vocab != "remap" and not is_same_vocab(src_d2t, src_t2d, v["d2t"], v["t2d"]):
        raise other_vocab(tc.init_from, src_d2t, v["d2t"])


def init_weights(
    draft: Eagle3Draft, path: str, d2t: torch.Tensor, t2d: torch.Tensor, lm_head_VD: torch.Tensor | None = None,
    remap: bool = False,
) -> dict[str, Any]:
    """Copy the trained draft at `path` (--train.init_from) into `draft` -> {dir, weights_sha256}
    for meta.json and the checkpoints (a resumed run still names it), plus `vocab` {copied, new}
    when the vocabulary was remapped. Refused unless it has the draft's shape (SHAPE_FIELDS) and
    vocabulary; `remap` (--train.init_vocab=remap) allows another draft vocabulary: lm_head rows
    by target token (`remap_head`, which needs the target's `lm_head_VD`)."""
    from eyas.assets import sha256_file

    files = init_files(path)
    src = open_draft(files.dir, draft.embed_weight)
    have, want = src.config.to_dict(), draft.config.to_dict()
    fields = [k for k in SHAPE_FIELDS if k != "draft_vocab_size"]  # the vocabulary check below says more
    diff = ", ".join(f"{k} {have[k]} there, {want[k]} here" for k in fields if have[k] != want[k])
    if diff:
        raise ConfigError(f"train.init_from={path!r} is another draft shape ({diff}): set the --train.* shape keys "
                          "(intermediate_size, num_layers, heads) to the draft's, or start without it")
    same_vocab = is_same_vocab(src.d2t, src.t2d, d2t, t2d)
    if not same_vocab and not remap:
        raise other_vocab(path, src.d2t, d2t)
    trained = dict(src.named_parameters())
    record: dict[str, Any] = {"dir": str(files.dir), "weights_sha256": sha256_file(files.weights)}
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name == "lm_head.weight" and not same_vocab:
                if lm_head_VD is None:
                    raise ValueError("init_weights(remap=True) on another vocabulary needs the target's lm_head_VD")
                head, record["vocab"] = remap_head(trained[name], src.d2t, d2t, lm_head_VD)
                p.copy_(head)
            else:
                p.copy_(trained[name])
    return record
