"""The trainer: build once, then `train_step` per optimizer step, log, evaluate, checkpoint.

Legend: B rows, S packed length, K aux layers, D hidden, V target vocab, W draft vocab, T TTT
steps, N teacher rows, M selected rows.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eyas.artifacts import atomic_write_text, hash_json, open_no_follow
from eyas.config import TrainConfig
from eyas.distributed import all_reduce_sum, gather_objects, rank0_flag
from eyas.draft import DraftConfig, Eagle3Draft
from eyas.errors import ArtifactError, EyasError, exception_message, raise_if_terminated, record_error
from eyas.train import checkpoint, resume as resuming
from eyas.train.data import Batch, batch_loader, epoch_batches
from eyas.train.loss import acceptance_length, chain_length, step_terms, step_weights, teacher_targets, weighted_loss
from eyas.train.parallel import clip_grad_norm, no_sync
from eyas.ttt import flex_masks, sdpa_masks


class TrainingDiverged(EyasError):
    """The loss or the gradient norm went NaN/inf; training stopped before applying the update."""


class TrainingCollapsed(EyasError):
    """The draft stopped learning (CollapseWatch): its gradient is 0 or its loss frozen at accuracy 0."""


FEW_STEPS = 10
"""Fewer optimizer steps than this, when the data sets their number (no train.max_steps), are refused."""


class CollapseWatch:
    """Counts the optimizer steps in a row of a collapsed training, from each logged window's global
    numbers (the same on every rank, so every rank stops together): steps whose gradient norm is
    exactly 0 while positions were trained, and windows whose loss equals the window before's (to
    1e-7 relative) at step-0 accuracy 0. `check` raises TrainingCollapsed at `limit` such steps, or
    at the end of a shorter run when its second half collapsed."""

    def __init__(self, limit: int, total: int, lr: float, max_tokens: int = 0):
        self.limit, self.total, self.lr, self.max_tokens = limit, total, lr, max_tokens
        self.dead = 0  # trailing steps with a zero gradient norm
        self.flat = 0  # trailing steps of windows with an unchanged loss at accuracy 0
        self.last_loss: float | None = None
        self.windows = self.valid = 0  # logged windows, and the positions trained in all of them

    def nothing_trained(self, steps: int) -> str:
        """Why a draft learnt nothing when no window trained a position ("" when some did, or none was
        logged): every row was cut at train.max_tokens before its first assistant token."""
        if not self.windows or self.valid:
            return ""
        return (f"no position was trained in {steps} optimizer steps: each packed row is cut at train.max_tokens="
                f"{self.max_tokens} tokens, and no sample has an assistant (loss-masked) token that early (its "
                "prompt and template come first). Raise --train.max_tokens to at least the length of a sample "
                "(prepare.max_length)")

    def check(self, done: int, step_norms: list[float], rec: dict[str, Any]) -> None:
        self.windows += 1
        self.valid += sum(rec["valid_T"])
        if not self.limit:
            return
        trained = sum(rec["valid_T"]) > 0
        for g in step_norms:
            self.dead = self.dead + 1 if trained and g == 0.0 else 0
        loss, acc0 = rec["loss"], rec["acc_T"][0]
        same = self.last_loss is not None and abs(loss - self.last_loss) <= 1e-7 * max(abs(loss), 1e-12)
        self.flat = self.flat + len(step_norms) if same and acc0 == 0 else 0
        self.last_loss = loss
        limit = self.limit if done < self.total else min(self.limit, max(2, self.total // 2))
        worst = max(self.dead, self.flat)
        if worst >= limit:
            if self.nothing_trained(done):
                raise TrainingCollapsed(f"training stopped at step {done}: {self.nothing_trained(done)}")
            what = (f"the gradient norm was exactly 0 over the last {self.dead} steps" if self.dead >= self.flat else
                    f"the loss stayed at {loss:.6g} with step-0 accuracy 0 over the last {self.flat} steps")
            raise TrainingCollapsed(
                f"training collapsed at step {done}: {what} (loss {loss:.4f}, step-0 accuracy {acc0:.3f}); the draft "
                f"no longer learns. The usual cause is a learning rate far too high (train.lr={self.lr:g}); lower it "
                "and train again (--train.resume=auto would continue the collapsed state). --train.collapse_steps=0 "
                "turns this check off")


def draft_fingerprint(model) -> torch.Tensor:
    """One float64 sum per parameter tensor (device-side): equal before and after a run only if no
    parameter changed."""
    with torch.no_grad():  # FSDP2: this rank's shard
        return torch.stack([getattr(p, "to_local", lambda p=p: p)().detach().double().sum() for p in model.parameters()])


@dataclass
class Teacher:
    """The target's lm_head and the draft-vocab maps: final states -> teacher targets."""

    lm_head_VD: torch.Tensor
    draft_ids_W: torch.Tensor
    target_to_draft_V: torch.Tensor
    chunk: int

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        final_ND = batch.final_BSD.flatten(0, 1)[batch.teacher_rows_N]
        return teacher_targets(final_ND, self.lm_head_VD, self.draft_ids_W, self.target_to_draft_V, self.chunk)


@dataclass
class Trainer:
    tc: TrainConfig
    model: nn.Module  # TTTDraft, possibly DDP/FSDP-wrapped
    draft: Eagle3Draft  # the plain module inside
    optimizer: torch.optim.Optimizer
    scheduler: Any
    teacher: Teacher
    device: torch.device
    autocast_dtype: torch.dtype | None
    attention: str  # "sdpa" | "flex"
    world_size: int = 1
    rank: int = 0
    states: Any = None  # OnlineStates in online mode
    init_from: dict[str, Any] | None = None  # train.init_from's {dir, weights_sha256[, vocab]}, kept in checkpoints
    identity: dict[str, Any] | None = None  # the data and vocabulary trained on (resume.data_identity), in checkpoints
    changes: list[dict[str, Any]] = field(default_factory=list)  # settings changed on resumes (resume.changes)
    weights_T: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.weights_T = step_weights(self.tc.ttt_steps, self.tc.step_weight, self.device)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def prepare(self, batch: Batch) -> Batch:
        """The batch on the draft's device with its states (idempotent: a prepared batch is returned as is)."""
        if self.states is not None and batch.aux_BSKD is None:  # online: the target fills aux/final
            try:
                batch = self.states(batch)
            except Exception as e:  # re-raised naming the samples; the cause keeps its traceback
                detail = f"{type(e).__name__}: {e}" if str(e).strip() else exception_message(e)
                what = "streamed states" if self.tc.mode == "stream" else "online target forward"
                raise EyasError(f"{what} failed on samples {batch.sample_ids}: {detail}") from e
        return batch.to(self.device, non_blocking=True)

    def forward(self, batch: Batch) -> list[torch.Tensor]:
        make_masks = flex_masks if self.attention == "flex" else sdpa_masks
        masks = make_masks(batch.doc_BS, self.tc.ttt_steps, pos_BS=batch.pos_BS, window=self.tc.sliding_window)
        with self.autocast():
            return self.model(batch.aux_BSKD, batch.input_ids_BS, batch.pos_BS, masks, batch.rows_T)


COUNTERS = ("loss_sum_T", "correct_T", "valid_T", "reached_T", "chain_T", "kept_T", "mask_T")
"""Per-TTT-step sums `train_step` returns and `summarize` turns into metrics (mask_T on the host); the
first six in the order `loss.step_terms` returns them."""


def num_valid(top1_N: torch.Tensor, tix_T: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(top1_N[tix] >= 0).sum() for tix in tix_T])


def terms(tr: Trainer, b: Batch, logits_T: list[torch.Tensor], p_NW: torch.Tensor, top1_N: torch.Tensor):
    compiled = tr.tc.loss_kernel == "compiled" or (tr.tc.loss_kernel == "auto" and tr.device.type == "cuda")
    return step_terms(logits_T, p_NW, top1_N, b.tix_T, b.rows_T, b.input_ids_BS.numel(),
                      tr.tc.top1_weight, tr.tc.align_top_k, compiled, tr.tc.loss)


def train_step(tr: Trainer, batches: list[Batch], step: int, before_sync=None) -> dict[str, torch.Tensor]:
    """One optimizer step over this rank's micro-batches of the accumulation window.

    `before_sync()` runs once every backward is queued and before the step's host sync (`Lookahead`
    prepares the next window there). -> local sums: COUNTERS (mask_T on the host, the others on the
    device), grad_norm (device), tokens (int).
    """
    batches = [tr.prepare(b) for b in batches]
    # The loss is normalised by the number of valid positions of the whole window on all ranks,
    # which needs every micro-batch's teacher top-1 before the first backward. With one micro-batch
    # its teacher is simply kept; with several, only the top-1 ids are kept from a first pass and
    # each teacher distribution (rows x W fp32) is recomputed right before its micro-batch: one
    # extra teacher matmul per micro-batch instead of a whole window of distributions in memory.
    single = len(batches) == 1
    first = [tr.teacher(b) for b in batches] if single else [(None, tr.teacher(b)[1]) for b in batches]
    valid_T = torch.stack([num_valid(top1, b.tix_T) for (_, top1), b in zip(first, batches)]).sum(0)
    global_valid_T = all_reduce_sum(valid_T.clone())
    loss_sum_T = torch.zeros_like(tr.weights_T)
    correct_T = torch.zeros_like(valid_T)
    reached_T = torch.zeros_like(valid_T)
    alive_T = torch.zeros_like(valid_T)
    trained_T = torch.zeros_like(valid_T)
    for j, (b, (p_NW, top1_N)) in enumerate(zip(batches, first)):
        if p_NW is None:
            p_NW = tr.teacher(b)[0]
        with no_sync(tr.model, sync=j == len(batches) - 1):
            logits_T = tr.forward(b)
            ls_T, cor_T, val_T, reach_T, chain_T, kept_T = terms(tr, b, logits_T, p_NW, top1_N)
            # align_norm kept: this micro-batch's kept rows stand in for its valid ones
            scaled_T = ls_T * (val_T / kept_T.clamp(min=1)) if tr.tc.align_norm == "kept" else ls_T
            # x world_size: DDP / FSDP average gradients over ranks, the global normaliser is a sum
            loss = weighted_loss(scaled_T, global_valid_T, tr.weights_T) * tr.world_size
            loss.backward()
        loss_sum_T += ls_T.detach()
        correct_T += cor_T
        reached_T += reach_T
        alive_T += chain_T
        trained_T += kept_T
    del first, p_NW, top1_N, logits_T, ls_T, scaled_T, loss  # the W-wide tensors, freed before the next window's states
    if before_sync is not None:
        before_sync()
    grad_norm = clip_grad_norm(tr.model, tr.tc.grad_clip)
    # .item(): one deliberate host sync per optimizer step, so a non-finite update is never applied
    if not bool((torch.isfinite(loss_sum_T).all() & torch.isfinite(grad_norm)).item()):
        raise_non_finite(step, batches, loss_sum_T, grad_norm)
    lr = tr.scheduler.get_last_lr()[0]  # this step's (after scheduler.step(): the next one's)
    tr.optimizer.step()
    tr.scheduler.step()
    tr.optimizer.zero_grad(set_to_none=True)
    # host-side counts stay on the host (a pageable host->device copy would wait for the GPU)
    mask_T = torch.tensor([sum(len(b.rows_T[i]) for b in batches) for i in range(tr.tc.ttt_steps)])
    return {"loss_sum_T": loss_sum_T, "correct_T": correct_T, "valid_T": valid_T, "reached_T": reached_T,
            "chain_T": alive_T, "kept_T": trained_T, "mask_T": mask_T, "grad_norm": grad_norm.detach().float(),
            "tokens": sum(b.num_tokens for b in batches), "lr": lr}


def raise_non_finite(step: int, batches: list[Batch], loss_sum_T: torch.Tensor, grad_norm: torch.Tensor) -> None:
    losses = loss_sum_T.tolist()
    bad = [f"loss of TTT step {i}" for i, v in enumerate(losses) if not math.isfinite(v)]
    term = ", ".join(bad) if bad else "gradient norm"
    ids = [s for b in batches for s in b.sample_ids]
    raise TrainingDiverged(
        f"step {step + 1}: non-finite {term} (loss sums per TTT step {losses}, grad norm {float(grad_norm)}) "
        f"on samples {ids}; lower --train.lr, check these samples' hidden states, or resume from an earlier checkpoint"
    )


def summarize(sums: dict[str, torch.Tensor], weights_T: torch.Tensor) -> dict[str, Any]:
    """Global metrics from summed counters (all-reduced here: one collective, one host sync)."""
    device = sums["loss_sum_T"].device
    packed = all_reduce_sum(torch.stack([sums[k].to(device, torch.float64) for k in COUNTERS]))
    loss_sum, correct, valid, reached, chain, kept, mask = packed.tolist()  # .tolist(): the logging sync point
    loss_T = [s / max(v, 1) for s, v in zip(loss_sum, valid)]
    acc_T = [c / max(m, 1) for c, m in zip(correct, mask)]
    w = weights_T.tolist()
    return {
        "loss": sum(wi * li for wi, li in zip(w, loss_T)),
        "loss_T": loss_T,
        "acc_T": acc_T,
        "tau": acceptance_length(acc_T),
        # the greedy chain teacher-forced: P(step i accepted | steps < i accepted), its length
        "chain_acc_rows_T": [c / max(r, 1) for c, r in zip(chain, reached)],
        "tau_chain_rows": chain_length(chain, mask[0]),
        "valid_T": [int(v) for v in valid],
        # the share of valid rows each step's loss trained on: 1 but under align_top_k, whose mask
        # keeps few rows of the later steps while the draft is still poor (a draft from scratch); 1 where
        # a step has no valid rows
        "trained_share_T": [k / v if v else 1.0 for k, v in zip(kept, valid)],
    }


@torch.no_grad()
def evaluate(tr: Trainer, loader, max_batches: int = 0) -> dict[str, Any]:
    tr.model.eval()
    sums = {k: torch.zeros(tr.tc.ttt_steps, device=tr.device, dtype=torch.float64)
            for k in COUNTERS if k != "mask_T"}
    sums["mask_T"] = torch.zeros(tr.tc.ttt_steps, dtype=torch.float64)  # host-side counts
    for n, b in enumerate(loader):
        if max_batches and n >= max_batches:
            break
        b = tr.prepare(b)
        p_NW, top1_N = tr.teacher(b)
        for k, sum_T in zip(COUNTERS, terms(tr, b, tr.forward(b), p_NW, top1_N)):  # in COUNTERS' order, mask_T aside
            sums[k] += sum_T
        sums["mask_T"] += torch.tensor([len(r) for r in b.rows_T], dtype=torch.float64)
    tr.model.train()
    return summarize(sums, tr.weights_T)


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


class Schedule:
    """Steps per epoch (fixed by the seed) and the optimizer-step -> (epoch, window) map."""

    def __init__(self, tc: TrainConfig, indices: list[int], lengths: torch.Tensor, seed: int, rank: int, world: int):
        self.tc, self.indices, self.seed, self.rank, self.world = tc, indices, seed, rank, world
        self.lengths = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
        self.steps_per_epoch = [len(self.plans(e, 0)) // tc.grad_accum for e in range(tc.epochs)]
        if not any(self.steps_per_epoch):
            raise EyasError(
                f"not enough training data for one optimizer step: {len(indices)} samples pack into fewer than "
                f"train.grad_accum x world size = {tc.grad_accum} x {world} micro-batches of "
                f"train.max_tokens={tc.max_tokens}; lower those or add data"
            )
        full = sum(self.steps_per_epoch)
        self.total = min(tc.max_steps, full) if tc.max_steps else full
        if not tc.max_steps and full < FEW_STEPS:
            raise EyasError(
                f"the training data makes only {full} optimizer step(s) ({len(indices)} samples x train.epochs="
                f"{tc.epochs}, packed into train.max_tokens={tc.max_tokens} x grad_accum {tc.grad_accum} x {world} "
                f"rank(s)): a draft trained so barely moves from its start. Add data (prepare.max_conversations, "
                f"regenerate), raise --train.epochs, lower --train.max_tokens, or set --train.max_steps to train "
                "that few steps on purpose")
        self.split_digest = hash_json(indices)[:16]  # in checkpoints: a resume on another split is flagged

    def plans(self, epoch: int, rank: int | None = None) -> list[list[int]]:
        r = self.rank if rank is None else rank
        return epoch_batches(self.indices, self.lengths, self.tc.max_tokens, self.seed, epoch, r, self.world)

    def position(self, step: int) -> tuple[int, int]:
        for e, n in enumerate(self.steps_per_epoch):
            if step < n:
                return e, step
            step -= n
        return len(self.steps_per_epoch), 0


def micro_batches(tr: Trainer, sched: Schedule, source, start_step: int, pad_multiple: int, num_workers: int):
    """Yield (step, epoch, [Batch] * grad_accum) from `start_step` to the end of the schedule."""
    step, accum = start_step, tr.tc.grad_accum
    while step < sched.total:
        epoch, window = sched.position(step)
        plans = sched.plans(epoch)[window * accum : sched.steps_per_epoch[epoch] * accum]
        if hasattr(tr.states, "expect"):  # stream: the engines are asked for this epoch's samples ahead, in order
            last = min(sched.steps_per_epoch[epoch], window + sched.total - step)
            tr.states.expect(epoch, sched.plans(epoch)[: last * accum], window * accum)
        it = iter(batch_loader(source, plans, tr.tc.ttt_steps, tr.tc.max_tokens, pad_multiple, num_workers,
                               pin=tr.device.type == "cuda", timeout_s=tr.tc.loader_timeout_s))
        for _ in range(window, sched.steps_per_epoch[epoch]):
            if step >= sched.total:
                return
            yield step, epoch, [next(it) for _ in range(accum)]
            step += 1


class Lookahead:
    """Iterates micro_batches' windows, each already prepared (`Trainer.prepare`). The next window is
    prepared by `launch_next`, which the loop hands to train_step as `before_sync`: online, the
    target's forward for the next window is launched before this step's host sync rather than after
    it, so its Python and launch overhead can overlap the GPU's work on this step (offline: the wait
    on the loader and the host->device copies). A host sync inside the target's forward would still
    wait for this step; the gain is not measured on a GPU yet. Holds two windows' states at a time;
    `close` drops the one prepared past the loop's end. `loader_s` adds up the host seconds spent
    getting windows from the loader and preparing them (the fit loop reads and resets it per logged
    window: near the window's own seconds, the loader, not the GPU, sets the pace)."""

    _END = object()

    def __init__(self, tr: Trainer, windows, start: int = 0):
        self.tr, self.windows, self.ready, self.loader_s = tr, windows, None, 0.0
        self.last = start - 1  # the last step whose window was loaded

    def __iter__(self) -> "Lookahead":
        return self

    def __next__(self) -> tuple[int, int, list[Batch]]:
        self.launch_next()
        ready, self.ready = self.ready, None
        if ready is self._END:
            raise StopIteration
        return ready

    def launch_next(self) -> None:
        if self.ready is not None:
            return
        t0 = time.perf_counter()
        try:
            step, epoch, batches = next(self.windows)
        except StopIteration:
            self.ready = self._END
            return
        except BaseException as e:  # the loader's: the window it could not load comes after the last one loaded
            with contextlib.suppress(AttributeError):
                e.eyas_context = {"step": self.last + 2, "sample_ids": [], "while": "loading that step's batches"}
            raise
        try:
            self.ready = (step, epoch, [self.tr.prepare(b) for b in batches])
        except BaseException as e:  # preparing the next window (online: the target's forward) is that step's
            with contextlib.suppress(AttributeError):
                e.eyas_context = {"step": step + 1, "sample_ids": [i for b in batches for i in b.sample_ids],
                                  "while": "preparing that step's batches"}
            raise
        self.last = step
        self.loader_s += time.perf_counter() - t0

    def close(self) -> None:
        self.ready = self._END
        self.windows.close()


def metrics_up_to(path: Path, step: int) -> list[str]:
    """The lines of metrics.jsonl at `path` with records up to `step`. A torn last line (a crash or a
    full disk mid-write; zeros a filesystem left after a power cut) is cut off with a note; a
    malformed line before it is an ArtifactError naming file:line."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    numbered = [(n, ln) for n, ln in enumerate(lines, 1) if ln.strip()]
    keep = []
    for n, ln in numbered:
        try:
            past = json.loads(ln)["step"] > step
        except (ValueError, TypeError, KeyError) as e:
            if n == numbered[-1][0]:
                print(f"[eyas:train] note: {path}:{n} is a torn record ({type(e).__name__}: {e}), left by a run "
                      "that died writing it: cut off", flush=True)
                break
            raise ArtifactError(f"{path}:{n} is not a metrics record ({type(e).__name__}: {e}): delete or repair "
                                "that line, then resume again") from e
        if not past:
            keep.append(ln)
    return keep


class MetricsLog:
    """metrics.jsonl (rank 0), optionally mirrored to TensorBoard."""

    def __init__(self, path: Path, rank: int, tensorboard: bool, resume_step: int):
        self.path, self.rank, self.tb = path, rank, None
        if rank != 0:
            return
        if path.exists():  # drop records past the checkpoint we resume from (a killed run wrote them)
            atomic_write_text(path, "".join(ln + "\n" for ln in metrics_up_to(path, resume_step)))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise EyasError("--train.tensorboard=true needs the tensorboard package (pip install tensorboard)") from e
            self.tb = SummaryWriter(str(path.parent / "tb"))

    def write(self, rec: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        with open_no_follow(self.path, "a", "point --train.out_dir elsewhere") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            split = rec["split"]
            for key in ("loss", "tau", "lr", "grad_norm", "tokens_per_s"):
                if key in rec:
                    self.tb.add_scalar(f"{split}/{key}", rec[key], rec["step"])
            for i, (lo, ac) in enumerate(zip(rec["loss_T"], rec["acc_T"])):
                self.tb.add_scalar(f"{split}/loss_{i}", lo, rec["step"])
                self.tb.add_scalar(f"{split}/acc_{i}", ac, rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def fit(tr: Trainer, sched: Schedule, source, eval_loader_fn, out: Path, draft_cfg: DraftConfig,
        resume: Path | None, pad_multiple: int, num_workers: int) -> dict[str, Any]:
    """The training loop; -> final metrics (last train window, final eval)."""
    tc = tr.tc
    start = 0
    prior: dict[str, float] = {"runs": 0, "steps": 0, "tokens": 0, "seconds": 0.0}  # earlier runs' work
    made: list[dict[str, Any]] = []  # the settings this resume changes, noted on its first logged record
    if resume is not None:
        state = checkpoint.load(resume, tr.model, tr.optimizer, tr.scheduler)
        start = state["step"]
        prior = state["all_runs"]
        tr.init_from = state["init_from"]  # where the run this continues started from
        made = resume_changes(tr, state, sched, start)
        if hasattr(tr.states, "resume"):  # stream: the checkpoint's ledgers (every rank's)
            tr.states.resume(state.get("stream"))  # None: a checkpoint of offline or online training
        if tr.rank == 0 and state["world_size"] != tr.world_size:
            print(f"[eyas:train] warning: {resume} was written by a run on {state['world_size']} ranks, this one runs "
                  f"on {tr.world_size}: the data order differs from the original run's", flush=True)
        if tr.rank == 0 and state["train_split"] != sched.split_digest:
            print(f"[eyas:train] warning: {resume} was trained on another split of the samples: held-out samples of "
                  "this run may have been trained on", flush=True)
    log = MetricsLog(out / "metrics.jsonl", tr.rank, tc.tensorboard, start)
    ckpt_root = out / "checkpoints"
    zero = {k: torch.zeros(tc.ttt_steps, device=tr.device if k != "mask_T" else "cpu", dtype=torch.float64)
            for k in COUNTERS}
    acc = {k: v.clone() for k, v in zero.items()}
    tokens, norms, t0, paused = 0, [], time.perf_counter(), 0.0  # paused: evaluation and checkpoints
    last_train: dict[str, Any] = {}
    last_eval: dict[str, Any] = {}
    windows_log: list[tuple[float, float]] = []  # (tokens, training seconds) of each logged window of this run
    side_s = {"eval": 0.0, "save": 0.0}  # the last held-out evaluation's and checkpoint's seconds (train.stop_by)

    def eval_due(n: int) -> bool:  # a held-out evaluation after step n (the last step's comes after the loop)
        return eval_loader_fn is not None and tc.eval_every > 0 and n % tc.eval_every == 0 and n < sched.total

    def save_due(n: int) -> bool:
        return tc.save_every > 0 and n % tc.save_every == 0 and n < sched.total

    step, epoch = start, sched.position(start)[0]
    end, t_fit = sched.total, time.perf_counter()
    watch = CollapseWatch(tc.collapse_steps, sched.total, tc.lr, tc.max_tokens)
    before = draft_fingerprint(tr.model)
    tr.model.train()
    windows = Lookahead(tr, micro_batches(tr, sched, source, start, pad_multiple, num_workers), start)
    for step, epoch, batches in windows:
        raise_if_terminated()
        try:
            out_s = train_step(tr, batches, step, before_sync=windows.launch_next)
        except BaseException as e:  # errors.jsonl names the step and this rank's samples (train/__init__.py)
            if not hasattr(e, "eyas_context"):  # (the next window's, when preparing it failed: Lookahead)
                with contextlib.suppress(AttributeError):
                    e.eyas_context = {"step": step + 1, "sample_ids": [i for b in batches for i in b.sample_ids]}
            raise
        if hasattr(tr.states, "trained"):  # stream: the ledger marks the step's samples trained
            tr.states.trained(batches)
        for k in acc:
            acc[k] += out_s[k]
        tokens += out_s["tokens"]
        norms.append(out_s["grad_norm"])
        done = step + 1
        if done % tc.log_every == 0 or done == sched.total:
            rec = summarize(acc, tr.weights_T)
            num_tokens = float(all_reduce_sum(torch.tensor(float(tokens), device=tr.device)).item())  # logging sync
            dt = time.perf_counter() - t0 - paused
            windows_log.append((num_tokens, dt))
            step_norms = torch.stack(norms).tolist()
            last_train = dict(step=done, epoch=epoch, split="train", **rec, lr=out_s["lr"],
                              grad_norm=sum(step_norms) / len(step_norms), tokens=int(num_tokens),
                              tokens_per_s=num_tokens / max(dt, 1e-9), seconds=dt, loader_s=windows.loader_s,
                              **({"changes": made} if made else {}),
                              **(tr.states.take_rates() if hasattr(tr.states, "take_rates") else {}))
            made = []
            windows.loader_s = 0.0
            log.write(last_train)
            if tr.rank == 0:
                share = rec["trained_share_T"]  # under align_top_k: the second TTT step's and the last one's
                trained = f"trained {share[1]:.2f}..{share[-1]:.2f} " if tc.align_top_k and len(share) > 1 else ""
                print(f"[eyas:train] step {done}/{sched.total} loss {rec['loss']:.4f} acc0 {rec['acc_T'][0]:.3f} "
                      f"tau {rec['tau']:.3f} chain rows {rec['tau_chain_rows']:.3f} lr {last_train['lr']:.2e} "
                      f"|g| {last_train['grad_norm']:.3f} {trained}"
                      f"{last_train['tokens_per_s']:.0f} tok/s (loader {last_train['loader_s']:.1f} of {dt:.1f} s)",
                      flush=True)
            if tr.rank == 0 and "stream_wait_s" in last_train:
                rec_s = last_train
                capacity = (f"engines {rec_s['stream_engine_tok_s']:.0f} tok/s, training {rec_s['stream_train_tok_s']:.0f} "
                            f"tok/s, achieved {rec_s['stream_efficiency']:.2f} of the slower; "
                            if "stream_engine_tok_s" in rec_s else "")
                print(f"[eyas:train] stream: {capacity}waited for states {rec_s['stream_wait_s']:.1f} s, engines held "
                      f"back {rec_s['stream_held_s']:.1f} s, {rec_s['stream_retries']} asked again, window "
                      f"{rec_s['stream_window_gb']:.2f} GB", flush=True)
            acc = {k: v.clone() for k, v in zero.items()}
            watch.check(done, step_norms, rec)
            # until the next logging step: a window as long as this one (its side work included) and
            # the evaluation and checkpoint due now, as long as the last ones (0 before the first)
            window_s = time.perf_counter() - t0 + side_s["eval"] * eval_due(done) + side_s["save"] * save_due(done)
            tokens, norms, t0, paused = 0, [], time.perf_counter(), 0.0
            if (tc.max_seconds or tc.stop_by) and done < sched.total:
                why = out_of_time(tr, elapsed_s=time.perf_counter() - t_fit, budget_s=tc.max_seconds, now=time.time(),
                                  window_s=window_s, stop_by=tc.stop_by)
                if why:
                    end = done
                    if tr.rank == 0:
                        print(f"[eyas:train] {why}: stopping at step {done} of {sched.total}", flush=True)
                    break
        t_side = time.perf_counter()
        if eval_due(done):
            last_eval = dict(step=done, epoch=epoch, split="eval", **evaluate(tr, eval_loader_fn(), tc.eval_max_batches))
            last_eval["seconds"] = side_s["eval"] = time.perf_counter() - t_side
            log.write(last_eval)
        if save_due(done):
            t_save = time.perf_counter()
            window = []  # the window in progress when a checkpoint falls between logging steps
            if done % tc.log_every:  # the same on every rank, as the all-reduce needs
                n = float(all_reduce_sum(torch.tensor(float(tokens), device=tr.device)).item())
                window = [(n, t_side - t0 - paused)]
            save(tr, ckpt_root, done, sched, draft_cfg, cumulative_work(prior, windows_log + window, done - start))
            side_s["save"] = time.perf_counter() - t_save
        paused += time.perf_counter() - t_side
    windows.close()  # a window prepared for a step past the time budget is dropped before evaluation
    changed = torch.tensor(float(not torch.equal(before, draft_fingerprint(tr.model))), device=tr.device)
    if start < end and float(all_reduce_sum(changed).item()) == 0:  # one verdict on every rank
        if watch.nothing_trained(end - start):  # (its counts are global: the same verdict on every rank)
            raise TrainingCollapsed(f"the draft did not change: {watch.nothing_trained(end - start)}")
        raise TrainingCollapsed(f"the draft did not change in {end - start} optimizer steps (train.lr={tc.lr:g}, "
                                f"last gradient norm {last_train.get('grad_norm', 0.0):.3g}): nothing was trained")
    if eval_loader_fn is not None:
        last_eval = dict(step=end, epoch=epoch, split="eval", **evaluate(tr, eval_loader_fn(), tc.eval_max_batches))
        log.write(last_eval)
    total = cumulative_work(prior, windows_log, end - start)
    if start < end or not checkpoint.checkpoints(ckpt_root):
        save(tr, ckpt_root, end, sched, draft_cfg, total)
    log.close()
    return {"train": last_train, "eval": last_eval, "steps_done": end, "stopped_early": end < sched.total,
            "resumed_from_step": start, "all_runs": total, "changes": tr.changes, **run_rates(windows_log)}


def resume_changes(tr: Trainer, state: dict[str, Any], sched: Schedule, start: int) -> list[dict[str, Any]]:
    """Apply this run's optimizer and schedule settings to the state resumed at `start` and record
    every setting that differs from the checkpoint's (tr.changes: all resumes'); -> this resume's."""
    made = resuming.changes(state, resuming.settings(tr.tc, sched), start)
    lr = resuming.apply_schedule(tr.optimizer, tr.scheduler, tr.tc, start)
    tr.changes = list(state.get("changes") or []) + made
    if made and tr.rank == 0:
        said = "; ".join(f"{c['key']} {c['from']} -> {c['to']}" for c in made)
        print(f"[eyas:train] resuming at step {start} with other settings, applied from here on (recorded in "
              f"metrics.jsonl and meta.json as changes): {said}; the schedule is this run's, step {start + 1} "
              f"of {sched.total} at lr {lr:.3g}", flush=True)
    return made


def run_rates(windows_log: list[tuple[float, float]]) -> dict[str, float | None]:
    """Training tokens/s of this run (evaluation and checkpoint pauses left out): over all its logged
    windows, and without the first, which holds the compilation of a compiled step."""
    def rate(w):
        seconds = sum(s for _, s in w)
        return sum(n for n, _ in w) / seconds if w and seconds > 0 else None

    return {"tokens_per_s": rate(windows_log), "tokens_per_s_after_first_window": rate(windows_log[1:])}


def cumulative_work(prior: dict[str, float], windows_log: list[tuple[float, float]], steps: int) -> dict:
    """The training behind a checkpoint over every run that led to it (a resumed run adds its own to the
    work recorded in the checkpoint it resumed from; a killed run's steps past its last checkpoint were
    redone, so they are not counted): runs, steps, tokens and seconds of the logged windows, tokens/s."""
    tokens = int(prior["tokens"] + sum(n for n, _ in windows_log))
    seconds = prior["seconds"] + sum(s for _, s in windows_log)
    return {"runs": prior["runs"] + int(steps > 0), "steps": prior["steps"] + steps, "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None}


def time_is_up(*, elapsed_s: float, budget_s: float, now: float, window_s: float, stop_by: float) -> str:
    """Why training stops at this logging step ('' = it goes on): `elapsed_s` of the loop past
    train.max_seconds (`budget_s`, 0 = none), or the time to the next logging step (`window_s`,
    estimated from the last window and the side work due) ending past train.stop_by (UNIX time,
    0 = none) from `now`."""
    if budget_s and elapsed_s > budget_s:
        return f"train.max_seconds={budget_s:g} reached"
    if stop_by and now + window_s > stop_by:
        return (f"train.stop_by={stop_by:.0f} {'passed' if now > stop_by else f'in {stop_by - now:.0f} s'}, "
                f"a logging window takes {window_s:.0f} s")
    return ""


def out_of_time(tr: Trainer, **clock: float) -> str:
    """`time_is_up(**clock)` by rank 0's clock, for every rank (called at a logging step, already a sync point)."""
    why = time_is_up(**clock)
    stop = rank0_flag(bool(why), tr.device)
    return why if tr.rank == 0 else "rank 0 is out of time" if stop else ""


def save(tr: Trainer, ckpt_root: Path, step: int, sched: Schedule, draft_cfg: DraftConfig,
         all_runs: dict | None) -> None:
    epoch, window = sched.position(step)
    trainer = {"epoch": epoch, "window": window, "world_size": tr.world_size, "total_steps": sched.total,
               "train_split": sched.split_digest, "all_runs": all_runs, "init_from": tr.init_from,
               "settings": resuming.settings(tr.tc, sched), "changes": tr.changes}
    if hasattr(tr.states, "state_dict"):  # stream: every rank's ledger, so a resume trains each sample once
        trainer["stream"] = gather_objects(tr.states.state_dict())
    checkpoint.save(ckpt_root, step, tr.model, tr.optimizer, tr.scheduler, draft_cfg, trainer, tr.rank,
                    tr.tc.keep_checkpoints, tr.identity)


def record_failure(out: Path, exc: BaseException, rank: int, step: int | None = None, sample_ids=(),
                   **context) -> None:
    """errors.jsonl: the failure with its rank, and the optimizer step and this rank's samples when it
    happened inside a step (`context`: what it was doing)."""
    record_error(out / "errors.jsonl" if out.is_dir() else None, exc, stage="train", rank=rank, sample_ids=sample_ids,
                 **({"step": step} if step is not None else {}), **context)
