"""export: an eyas draft checkpoint -> the directories SGLang and vLLM serve.

    eyas export runs/eyas/train --format both --out_dir runs/eyas/export   # single process
    eyas export recipe.yaml --export.dtype=float32 --export.checkpoint=step_2000

(Export is a few seconds of CPU work; it never runs under torchrun.)

Output: OUT/sglang/ and/or OUT/speculators/, each config.json + model.safetensors, and OUT/meta.json. Export
removes or overwrites only files its own records there name (`claim_out_dir`): anything else in
its way is an error naming it.

    vllm serve OUT/speculators                          # vLLM finds the verifier in the config
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "OUT/sglang", "num_speculative_tokens": 3}'
    python -m sglang.launch_server --model TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT/sglang

The layouts, their key tables and aux-layer-id conventions live in eyas.draft_files; this stage
checks the checkpoint against the stages it came from (train, prepare, extract records and the
target), optionally averages it with other drafts (export.average_with), and writes the layouts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eyas.artifacts import atomic_write_json, file_record, read_meta, write_meta
from eyas.config.export import FORMATS
from eyas.draft import DraftConfig, Eagle3Draft
from eyas.draft_files import (CONFIG, DRAFT_CONFIG, WEIGHTS, export_draft, find, load_draft, locate, open_draft,
                              sglang_aux_ids, vllm_aux_ids)
from eyas.errors import ArtifactError


# --- consistency with the stages the draft came from --------------------------------------------


def _refuse(what: str, fix: str) -> None:
    raise ArtifactError(f"{what}: {fix}")


def check_target(c: DraftConfig, target_config: Any) -> None:
    fix = "pass the --target.model the draft was trained for"
    if c.vocab_size != target_config.vocab_size:
        _refuse(f"draft vocab_size={c.vocab_size} but the target has vocab_size={target_config.vocab_size}", fix)
    if c.target_hidden_size != target_config.hidden_size:
        _refuse(f"draft target_hidden_size={c.target_hidden_size} but the target has hidden_size={target_config.hidden_size}", fix)


def check_train_meta(c: DraftConfig, train_meta: dict[str, Any], target_model: str) -> None:
    """The checkpoint against the train stage's record of what it trained."""
    fix = "re-run `eyas train` (or export the checkpoint that meta.json describes)"
    draft = train_meta.get("draft")
    if draft is not None:
        for key, value in c.to_dict().items():
            if key in draft and draft[key] != value:
                _refuse(f"draft_config.{key}={value!r} but the train meta.json records {draft[key]!r}", fix)
    trained_for = (train_meta.get("target") or {}).get("model")
    if trained_for is not None and trained_for != target_model:
        _refuse(
            f"the draft was trained for target {trained_for!r} but --target.model={target_model!r}",
            "pass the --target.model the draft was trained for",
        )


def check_prepare(c: DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor, prepare_dir: Path, meta_sha256: str | None) -> str:
    from eyas.artifacts import hash_json

    meta = read_meta(prepare_dir, "prepare")
    fix = f"re-run `eyas train` on {prepare_dir} (or point --export.prepare_dir at the prepare output the draft was trained on)"
    if meta_sha256 and hash_json(meta) != meta_sha256:
        _refuse(f"{prepare_dir}/meta.json changed after the draft was trained", fix)
    vocab = load_file(str(prepare_dir / "vocab.safetensors"))
    if vocab["d2t"].numel() != c.draft_vocab_size:
        _refuse(f"draft_vocab_size={c.draft_vocab_size} but {prepare_dir} selected {vocab['d2t'].numel()} draft tokens", fix)
    if vocab["t2d"].numel() != c.vocab_size:
        _refuse(f"vocab_size={c.vocab_size} but {prepare_dir} maps a vocabulary of {vocab['t2d'].numel()}", fix)
    if not torch.equal(vocab["d2t"], d2t):
        _refuse(f"the draft's d2t differs from {prepare_dir}/vocab.safetensors", fix)
    if not torch.equal(vocab["t2d"], t2d):
        _refuse(f"the draft's t2d differs from {prepare_dir}/vocab.safetensors", fix)
    return f"vocabulary (d2t, t2d, draft_vocab_size={c.draft_vocab_size}) matches {prepare_dir}"


def check_extract(c: DraftConfig, extract_dir: Path, meta_sha256: str | None, num_target_layers: int | None) -> str:
    from eyas.artifacts import hash_json

    meta = read_meta(extract_dir, "extract")
    fix = f"re-run `eyas train` on {extract_dir} (or point --export.extract_dir at the extract output the draft was trained on)"
    if meta_sha256 and hash_json(meta) != meta_sha256:
        _refuse(f"{extract_dir}/meta.json changed after the draft was trained", fix)
    if "layer_ids" not in meta:
        _refuse(f"{extract_dir}/meta.json records no layer_ids", "re-run `eyas extract`")
    if list(meta["layer_ids"]) != list(c.aux_layer_ids):
        _refuse(f"aux_layer_ids={c.aux_layer_ids} in the draft but {extract_dir} holds layers {list(meta['layer_ids'])}", fix)
    if "hidden_size" in meta and meta["hidden_size"] != c.target_hidden_size:
        _refuse(f"target_hidden_size={c.target_hidden_size} in the draft but {extract_dir} holds hidden_size={meta['hidden_size']}", fix)
    if num_target_layers is not None and meta.get("num_hidden_layers", num_target_layers) != num_target_layers:
        _refuse(
            f"{extract_dir} was extracted from a target with {meta['num_hidden_layers']} layers, --target.model has {num_target_layers}",
            "pass the --target.model the draft was trained for",
        )
    return f"aux layer ids {c.aux_layer_ids} match {extract_dir}"


def check_against_stages(
    c: DraftConfig,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    train_meta: dict[str, Any] | None,
    prepare_dir: Path,
    extract_dir: Path | None,
    target_config: Any | None = None,
    target_model: str = "",
) -> list[str]:
    """Refuse a draft that disagrees with its train/prepare/extract records or the target; -> notes.

    Stage outputs that do not exist are skipped with a note (a draft trained elsewhere has none).
    """
    notes = []
    inputs = (train_meta or {}).get("inputs") or {}
    if train_meta is not None:
        check_train_meta(c, train_meta, target_model)
    if target_config is not None:
        check_target(c, target_config)
    if (prepare_dir / "meta.json").is_file():
        notes.append(check_prepare(c, d2t, t2d, prepare_dir, (inputs.get("prepare") or {}).get("meta_sha256")))
    else:
        notes.append(f"no prepare output at {prepare_dir}: vocabulary not cross-checked")
    streamed = (inputs.get("stream") or {}).get("layer_ids")
    if extract_dir is None and streamed is not None:  # the engines captured the layers train recorded
        if list(streamed) != list(c.aux_layer_ids):
            raise ArtifactError(f"the draft reads aux layers {list(c.aux_layer_ids)}, its training streamed layers "
                                f"{list(streamed)} (train meta.json inputs.stream): export the draft that run trained")
        notes.append(f"trained on streamed states of layers {list(streamed)}: aux layer ids match")
    elif extract_dir is None:
        notes.append("trained online (no extract stage): aux layer ids not cross-checked with an extract output")
    elif (extract_dir / "meta.json").is_file():
        num_layers = getattr(target_config, "num_hidden_layers", None)
        notes.append(check_extract(c, extract_dir, (inputs.get("extract") or {}).get("meta_sha256"), num_layers))
    else:
        notes.append(f"no extract output at {extract_dir}: aux layer ids not cross-checked")
    return notes


def checkpoint_dir(train_dir: Path, checkpoint: str) -> Path:
    """TRAIN_DIR/<checkpoint>, or TRAIN_DIR itself when it is a draft checkpoint."""
    for d in (train_dir, train_dir / checkpoint):
        files = find(d)
        if files is not None and files.kind == "checkpoint":
            return d
    raise ArtifactError(
        f"{train_dir / checkpoint} holds no draft checkpoint ({DRAFT_CONFIG}): run `eyas train` first, or pass "
        "--export.checkpoint=<subdirectory> / a checkpoint directory as TRAIN_DIR"
    )


def train_meta_for(train_dir: Path, ckpt: Path) -> dict[str, Any] | None:
    """The train stage's meta.json for this checkpoint (final/ has its own copy), if any."""
    for d in (ckpt, train_dir):
        if (d / "meta.json").is_file():
            return read_meta(d, "train")
    return None


def stage_dir_for(explicit: str, train_meta: dict[str, Any] | None, stage: str, cfg) -> Path:
    """--export.<stage>_dir, else the one the train meta.json names, else the config's stage directory."""
    if explicit:
        return Path(explicit)
    recorded = ((train_meta or {}).get("inputs") or {}).get(stage) or {}
    return Path(recorded["dir"]) if recorded.get("dir") else cfg.stage_dir(stage)


def main(cfg) -> int:
    from eyas.artifacts import atomic_write_text, hash_json
    from eyas.config import dump_config, to_dict
    from eyas.target import describe_target, load_config, load_hf_config, model_path

    e = cfg.export
    train_dir = Path(e.train_dir) if e.train_dir else cfg.stage_dir("train")
    ckpt = checkpoint_dir(train_dir, e.checkpoint)
    train_meta = train_meta_for(train_dir, ckpt)
    model = load_draft(ckpt)
    c = model.config
    tcfg = load_config(cfg.target)
    prepare_dir = stage_dir_for(e.prepare_dir, train_meta, "prepare", cfg)
    online = (((train_meta or {}).get("config") or {}).get("train") or {}).get("mode") in ("online", "stream")
    # a draft trained online or streamed read no extract output: one left in RUN_DIR by an earlier run is not its data
    extract_dir = None if online and not e.extract_dir else stage_dir_for(e.extract_dir, train_meta, "extract", cfg)
    notes = check_against_stages(c, model.d2t, model.t2d, train_meta, prepare_dir, extract_dir, tcfg, cfg.target.model)
    averaged = average_with(model, e.average_with)
    out = cfg.stage_dir("export")
    claim_out_dir(out, e.formats)
    written = export_draft(
        model,
        out,
        e.formats,
        e.dtype,
        num_target_layers=tcfg.num_hidden_layers,
        verifier=model_path(cfg.target),
        # the checkpoint's own class (a multimodal wrapper's, e.g. KimiK25ForConditionalGeneration, not its
        # text model's): what vLLM resolves for the verifier named beside it
        verifier_arch=list(getattr(load_hf_config(cfg.target), "architectures", None) or []),
        num_speculative_tokens=e.num_speculative_tokens,
    )
    atomic_write_text(out / "config.yaml", dump_config(cfg))
    write_meta(
        out,
        "export",
        config=to_dict(cfg),
        target=describe_target(cfg.target),
        inputs={"checkpoint": str(ckpt), "draft_config_sha256": hash_json(c.to_dict()),
                "train_meta_sha256": hash_json(train_meta) if train_meta else None, "average_with": averaged},
        formats={fmt: str(p) for fmt, p in written.items()},
        dtype=e.dtype,
        aux_layer_ids={"eyas_hf_index": c.aux_layer_ids, "vllm": vllm_aux_ids(c.aux_layer_ids),
                       "sglang": sglang_aux_ids(c.aux_layer_ids)},
        checks=notes,
        files=file_record(out, sorted(str(f.relative_to(out)) for p in written.values() for f in Path(p).rglob("*")
                                      if f.is_file())),
    )
    for fmt, p in written.items():
        print(f"[eyas:export] {fmt:12s} -> {p}")
    for n in notes:
        print(f"[eyas:export] {n}")
    for a in averaged:
        print(f"[eyas:export] averaged with {a['dir']} (sha256 {a['weights_sha256'][:12]}; "
              f"{a['lm_head_rows_shared']:,} of {c.draft_vocab_size:,} lm_head rows shared)")
    return 0


# --- what export may replace in its output directory ---------------------------------------------

LEDGER = ".eyas-export-files.json"
"""The files export writes in its output directory, recorded before it writes them (meta.json,
written last, records them again with their sha256): an export cut short still owns its files."""
LAYOUTS = tuple(f for f in FORMATS if f != "both")
OWN = ("meta.json", "config.yaml")


def layout_files(formats) -> list[str]:
    return [f"{fmt}/{name}" for fmt in formats for name in (WEIGHTS, CONFIG)]


def recorded_files(out: Path) -> set[str]:
    """The files export's own records in `out` say it wrote: an export meta.json's `files` (and
    itself and config.yaml), and the ledger."""
    own: set[str] = set()
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if isinstance(meta, dict) and meta.get("stage") == "export":
        own |= set(meta.get("files") or {}) | set(OWN)
    try:
        own |= set(json.loads((out / LEDGER).read_text()))
    except (OSError, ValueError, TypeError):
        pass
    return own


def is_own(rel: str, own: set[str]) -> bool:
    """A recorded file, or the temporary file eyas writes it through (NAME.tmp, NAME.tmp-XXXX)."""
    base, _, tail = rel.rpartition(".tmp")
    return rel in own or (base in own and (tail == "" or tail.startswith("-")))


def in_the_way(out: Path, own: set[str]) -> list[Path]:
    """Paths export would overwrite or remove (meta.json, config.yaml, each layout's folder) that its
    records do not say it wrote; symlinks among them too (eyas makes none)."""
    bad = [out / rel for rel in OWN if (out / rel).is_symlink() or (out / rel).exists() and not is_own(rel, own)]
    for fmt in LAYOUTS:
        p = out / fmt
        if p.is_symlink() or p.exists() and not p.is_dir():
            bad.append(p)
        elif p.is_dir():
            bad += [f for f in sorted(p.rglob("*")) if (f.is_symlink() or not f.is_dir())
                    and not is_own(str(f.relative_to(out)), own)]
    return bad


def claim_out_dir(out: Path, formats) -> None:
    """Make `out` ready for this export: refuse (naming them) the files in the way that export's
    records do not say it wrote, so a folder of someone else's is never removed or overwritten;
    record what it is about to write; remove its own layouts that --format no longer asks for."""
    out.mkdir(parents=True, exist_ok=True)
    own = recorded_files(out)
    bad = in_the_way(out, own)
    if bad:
        shown = ", ".join(map(str, bad[:3])) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ArtifactError(f"{shown}: in the way of the export to {out}, and not written by `eyas export` (its "
                            f"records there, meta.json and {LEDGER}, do not name it): nothing is removed or "
                            "overwritten; move it away, or point --export.out_dir elsewhere")
    (out / "meta.json").unlink(missing_ok=True)  # incomplete from here until it is written again
    known = set(layout_files(LAYOUTS))  # a record names only these (a hand-edited `sglang/../../x` is no file of its)
    stale = [rel for rel in sorted(own & known) if rel.split("/", 1)[0] not in formats]
    for rel in stale:  # a layout from an earlier --format must not linger: its files, then its folder if emptied
        (out / rel).unlink(missing_ok=True)
    for fmt in LAYOUTS:
        if fmt not in formats and (out / fmt).is_dir() and not any((out / fmt).iterdir()):
            (out / fmt).rmdir()
    atomic_write_json(out / LEDGER, sorted((own - set(stale)) | set(layout_files(formats)) | set(OWN)))


def average_with(model: Eagle3Draft, dirs: list[str]) -> list[dict[str, Any]]:
    """export.average_with: `model` averaged in place with the exported drafts in `dirs`; what was
    averaged (directory, weights sha256, lm_head rows shared) for meta.json."""
    from eyas.assets import sha256_file
    from eyas.average import average_drafts

    if not dirs:
        return []
    files = [locate(d, "export.average_with") for d in dirs]
    others = [open_draft(f.dir) for f in files]
    shared = average_drafts(model, others, dirs)
    return [{"dir": str(f.dir.resolve()), "weights_sha256": sha256_file(f.weights), **s}
            for f, s in zip(files, shared, strict=True)]
