from __future__ import annotations

import math
from dataclasses import dataclass, field

from eyas.config.base import require
from eyas.config.stream import StreamConfig

MODES = ("offline", "online", "stream")
PRECISIONS = ("auto", "bf16", "fp32")
PARALLELS = ("auto", "ddp", "fsdp")
ATTENTIONS = ("auto", "sdpa", "flex")
DRAFT_ATTENTIONS = ("gqa", "mla")
LOSS_KERNELS = ("auto", "eager", "compiled")
LOSSES = ("kl", "tv", "lk")
ALIGN_NORMS = ("valid", "kept")
INIT_VOCABS = ("same", "remap")
INIT_HEADS = ("random", "target")
NORMS = ("eagle3", "eagle3.1")
FLOAT_KNOBS = ("step_weight", "top1_weight", "lr", "min_lr_ratio", "warmup_ratio", "weight_decay", "grad_clip",
               "max_seconds", "stop_by", "rope_theta", "eval_fraction", "loader_timeout_s")


@dataclass
class TrainConfig:
    mode: str = "offline"
    """offline: read the target's hidden states from the extract stage's shards; online: run the
    target in the same job on each batch (no disk; needs the prepare stage only); stream: vLLM
    engines (Ray actors) capture the states and hand them over through Mooncake's store
    (train.stream; no disk; needs the prepare stage only)."""
    ttt_steps: int = 7
    """Training-time-test steps: how many tokens ahead the draft is unrolled on its own outputs."""
    step_weight: float = 0.8
    """Loss weight of TTT step i is step_weight**i (the EAGLE-3 reference uses 0.8)."""
    top1_weight: float = 0.0
    """Share of each position's loss on the target's top-1 token alone: (1 - w) x the soft
    cross-entropy against the teacher distribution (the EAGLE-3 reference's, w = 0) + w x the
    cross-entropy against its top-1. Greedy serving accepts a draft token exactly when it is that
    top-1; sampled serving accepts by the whole distribution. The logged train and held-out losses
    are this mixed loss: compare accuracies, not losses, across values of w. Experimental: on
    SmolLM2-135M w = 1 read below w = 0 on held-out accuracy and MT-bench tau (chain 2.98 against
    3.04 on the same data, docs/benchmarks.md); 0 < w < 1 has not been measured."""
    loss: str = "kl"
    """Each position's soft loss between the teacher's distribution p over the draft vocabulary (the
    target's logits of the draft tokens, softmaxed) and the draft's q; alpha = sum min(p, q) is the
    chance that speculative sampling accepts the drafted token. kl: the soft cross-entropy
    -sum p log q (forward KL up to p's entropy; the EAGLE-3 reference's): mass-covering, with strong
    gradients from a random start. tv: the total variation 0.5 sum |p - q| = 1 - alpha: its minimum
    is the best acceptance a draft can reach, which kl only approaches through a proxy when the draft
    cannot match p everywhere; but its gradient is alpha's, tiny while q and p barely overlap (a
    random draft's alpha is about 1/W). lk: -log alpha (the LK losses paper's, arXiv 2602.23881;
    speculators' `nla`): tv's optimum with the gradient scaled by 1/alpha, so it trains from a random
    start; against a one-hot p it is the top-1 cross-entropy. Same definitions as speculators'
    losses except lk's clamp: speculators clamps alpha at 1e-5, which stops the gradient of every
    position below it (a random draft over more than 100k tokens starts there wherever the target is
    confident); eyas floors alpha only at the smallest normal float32 (~1.2e-38), so the loss stays
    finite (<= 87.3) and each position's gradient has an L1 norm of at most 2, as kl's, unless its
    alpha underflows float32. All three see p renormalised to the draft vocabulary: serving's alpha
    is lower by up to the target's mass outside it.
    train.top1_weight w mixes with whichever is chosen: (1 - w) x this loss + w x the top-1
    cross-entropy (tv lies in [0, 1], the cross-entropy in nats: weigh w accordingly). The logged
    train and held-out losses are this loss: compare accuracies and tau across kinds, not losses.
    Cost: on the SmolLM2 draft's benchmark step (H100) tv and lk each took 1.27x kl's time with
    the eager loss kernel (in 37 GiB against kl's 49) and 1.06x with train.loss_kernel=compiled
    (docs/benchmarks.md). Experimental: their effect on acceptance has not been measured in
    eyas; kl stays the default."""
    align_top_k: int = 0
    """Train TTT step i only at positions where the target's top-1 was among the draft's k best at
    every earlier step (GRIFFIN's token-alignable training; 1 = the greedy chain: serving never
    drafts past a rejected token, so positions after a miss only spend the draft's capacity).
    0 = every position trains (the EAGLE-3 reference). The logged accuracies stay over all
    positions; chain_acc_rows_T and tau_chain_rows are the greedy chain's, whatever k.
    Experimental: on SmolLM2-135M k = 1 showed no gain, k = 3 with align_norm=kept gained a little
    on a draft trained on with it (docs/benchmarks.md) and trained slower from random weights."""
    align_norm: str = "valid"
    """What divides step i's loss under align_top_k: valid = its valid positions (kept or not), so a
    step weighs less as fewer of its positions stay aligned; kept = the positions align_top_k keeps
    (GRIFFIN's), so every step keeps its weight step_weight**i. Exact with one micro-batch on one
    rank; with several micro-batches or ranks each one's step loss is rescaled by its own valid /
    kept count (no extra collective): a valid-weighted mean of the micro-batches' kept means, in
    which a micro-batch that keeps none of its valid rows counts for nothing."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.0
    """The cosine schedule decays to lr * min_lr_ratio at the last step."""
    warmup_ratio: float = 0.02
    """Fraction of the optimizer steps spent in linear warmup (ignored when warmup_steps > 0)."""
    warmup_steps: int = 0
    """Linear warmup length in optimizer steps; 0 = use warmup_ratio."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 0.5
    """Clip the global gradient norm to this value (0 = no clipping; the norm is still logged)."""
    epochs: int = 1
    """Passes over the training split."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = epochs x batches per epoch)."""
    max_seconds: float = 0.0
    """Wall-clock budget of the training loop (0 = none): at the first logging step past it,
    training stops early, checks, saves and writes `final` as at the end (meta.json records the
    steps done and `stopped_early`). The learning-rate schedule still spans the planned steps."""
    stop_by: float = 0.0
    """Wall-clock deadline as UNIX time in seconds (0 = none), e.g. a scheduler job's end minus the
    minutes that the final evaluation, saving and export take: at each logging step training stops
    early (as with max_seconds) when the next logging step would come past it (estimated as the
    last window's wall time plus the held-out evaluation and checkpoint due at this step, at their
    last durations: leave room for the first evaluation, which has no earlier one). Unlike
    max_seconds it counts what comes before the training loop too (data, target load, earlier
    stages of `eyas run`). Like max_seconds, not part of `eyas run`'s key."""
    max_tokens: int = 8192
    """Token budget of one micro-batch on one rank: samples (shuffled per epoch) are packed into one
    row until the next one would exceed it; a sample longer than the budget is truncated to it."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank (gradient accumulation). One teacher
    distribution (rows x W fp32) exists at a time; the window's loss normaliser needs every
    micro-batch's teacher top-1 first, so with grad_accum > 1 the teacher matmul runs twice per
    micro-batch (~6% more FLOPs for a Llama-3.1-8B draft)."""
    pad_multiple: int = 0
    """Pad each packed micro-batch to a multiple of this many tokens (0 = with flex attention every
    row padded to max_tokens rounded up to 128, one shape that compiles once; else no padding).
    Padding never enters the loss."""
    precision: str = "auto"
    """auto (bf16 autocast on GPU, fp32 on CPU), bf16 (autocast; master weights and optimizer stay
    fp32) or fp32."""
    parallel: str = "auto"
    """How the draft is replicated across ranks under torchrun: ddp, fsdp (FSDP2 fully_shard, for
    large drafts) or auto (ddp). World size 1 runs the plain module."""
    compile: bool = False
    """torch.compile the draft's decoder step (GPU)."""
    loss_kernel: str = "eager"
    """How each TTT step's loss and accuracy are computed from its W-wide logits: eager (plain torch
    ops, each a pass over float32 rows x W), compiled (the same function under torch.compile, fused:
    a few passes over the logits, the teacher rows gathered inside) or auto (compiled on CUDA, eager
    elsewhere). Both compute the same loss up to float32 rounding. Experimental: on one H200 the
    compiled loss made the SmolLM2 draft's benchmark step 1.54x faster (every position in the loss)
    but a real run no faster, after minutes of compiling for new row counts in each process
    (docs/benchmarks.md): measure it on your draft (bench/train.py --loss-kernel) before choosing it."""
    attention: str = "auto"
    """TTT attention kernel: sdpa (explicit boolean [S, (i+1)S] masks: memory and time quadratic in
    the row length, fine for CPU-sized rows), flex (FlexAttention block masks that skip empty tiles,
    CUDA only; rows padded to one fixed length, compiled once, about a minute) or auto (flex on
    CUDA, sdpa on CPU)."""
    teacher_chunk: int = 1024
    """Tokens per chunk when applying the target's lm_head to the final hidden states, so the
    V-wide logits never exist for the whole batch."""
    num_attention_heads: int = 0
    """Draft attention heads (0 = the target's)."""
    num_key_value_heads: int = 0
    """Draft key/value heads (0 = the target's)."""
    head_dim: int = 0
    """Draft head dimension (0 = the target's)."""
    intermediate_size: int = 0
    """Draft MLP width (0 = the target's)."""
    num_layers: int = 1
    """Draft decoder layers. 1 is EAGLE-3's single layer, which vLLM and SGLang both serve; more
    stack plain Llama decoder layers after it (vLLM's multi-layer EAGLE-3): served by vLLM only, so
    export them with --export.format=speculators. Each layer adds its attention and MLP to every
    draft step: on SmolLM2-135M two layers raised MT-bench tau (chain 3.33 / tree 5.06 against 3.28 /
    4.83) but made each draft pass 46-49% slower, 1.76x / 1.81x against 1.96x / 2.05x
    (docs/benchmarks.md); a deeper draft pays where the target's forward dwarfs the draft's."""
    rope_theta: float = 0.0
    """Draft RoPE base (0 = the target's; scaling always follows the target's config)."""
    norm_before_residual: bool = False
    """Use hidden_norm(h) instead of h as the attention residual (the variant some vLLM /
    speculators checkpoints use); recorded in draft_config.json."""
    norms: str = "eagle3"
    """eagle3: EAGLE-3's norms. eagle3.1: EAGLE 3.1's two additions (vLLM's draft config fields
    `fc_norm` and `norm_output`): each aux state gets an RMSNorm of its own before fc, and the state
    fed back to the next draft step is the final norm's output (the one lm_head reads) instead of
    the pre-norm one. vLLM serves it; SGLang's llama_eagle3.py reads neither field, so export it
    with --export.format=speculators. Not measured here: whether it raises tau on a draft eyas
    trains is untested."""
    draft_attention: str = "gqa"
    """The draft layer's attention: gqa (Llama-style grouped-query attention, any target) or mla
    (multi-head latent attention with the target's own latent and head sizes, as the published
    DeepSeek-V3 / Kimi-K2.5 EAGLE-3 drafts have; MLA targets only, one draft layer). An MLA draft is
    exported in the layout vLLM's deepseek_eagle3.py (Eagle3DeepseekV3ForCausalLM) and SGLang load:
    --export.format=sglang, served with --speculative-config (vLLM's speculators layout builds only
    Llama / Qwen3 draft layers)."""
    sliding_window: int = 0
    """N > 0: the draft attends only to the last N positions (a query at position p sees keys at
    p-N+1 .. p), in training (every TTT step, its keys at their RoPE positions), in eyas's decoding
    and evaluation, and in the export (speculators layout: `sliding_window` plus `layer_types` of
    "sliding_attention", the keys vLLM's models/llama.py reads). A windowed draft's attention cost
    and KV cache stop growing with the context; it is meant for contexts longer than those the draft
    was trained on (docs/benchmarks.md#draft-designs has what was measured). 0 = full attention.
    SGLang applies no window from a draft's config: export with --export.format=speculators."""
    target_device: str = ""
    """Online mode: where the target runs: a device (cuda:1 keeps it off the draft's GPU), or
    auto / balanced / sequential to spread it over the visible GPUs with accelerate's device_map
    (empty = the draft's device)."""
    target_group_tokens: int = 0
    """Online mode: 0 = each batch's samples go through the target in one forward, padded to the
    longest; N > 0 = in groups of similar length, cut where the padding saved outweighs N tokens'
    worth of one more forward (`eyas.train.data.row_groups`). Experimental: on SmolLM2-135M (one
    H200) ~3 groups of similar length took as long as one padded forward (104 against 106 ms per
    16k-token batch); a large, compute-bound target may gain from groups (not measured)."""
    eval_fraction: float = 0.02
    """Fraction of samples held out for evaluation (at least one sample when > 0). The split keeps
    together samples whose ids share a stem (ShareGPT's `X_0`, `X_1`: one conversation) or whose
    prompts are identical, so held-out numbers are not inflated by near-copies seen in training."""
    eval_every: int = 0
    """Evaluate the held-out split every this many optimizer steps (0 = only at the end)."""
    eval_max_batches: int = 0
    """Cap on held-out micro-batches per evaluation (0 = all)."""
    log_every: int = 10
    """Log loss, accuracy per TTT step, acceptance length, lr, grad norm, tokens/s every N steps."""
    collapse_steps: int = 10
    """Stop with the numbers when training has collapsed for this many steps in a row: the gradient
    norm exactly 0, or the loss unchanged to 1e-7 with step-0 accuracy 0 across logged windows (a
    dead draft: its outputs no longer depend on its weights, typically a learning rate far too
    high). A run that ends sooner is judged over its second half. 0 = never."""
    save_every: int = 500
    """Write a checkpoint every N optimizer steps (0 = only the final one)."""
    keep_checkpoints: int = 2
    """Keep this many most recent checkpoints (0 = keep all)."""
    init_from: str = ""
    """A trained draft to start from instead of random weights: an eyas draft directory (train's
    `final/`: draft.safetensors + draft_config.json) or an exported one (`eyas export`, either
    layout: model.safetensors + config.json; a bf16 export starts the fp32 master weights from bf16
    values). Its shape, aux layers and draft vocabulary must be this run's; the optimizer and the
    learning-rate schedule (warmup, cosine) start afresh. For training a draft further than one
    run's budget on new data or with a new schedule; `resume` continues the same run instead (a
    resumed run reads its checkpoint, not this; meta.json's inputs name the draft and its sha256).
    `eyas run` keys the train stage on this path, not on the file's content. Empty = random
    initialisation."""
    init_vocab: str = "same"
    """What train.init_from's draft vocabulary must be. same: this run's (d2t and t2d equal; else
    refused). remap: any, e.g. a draft trained with a smaller prepare.draft_vocab_size moved to a
    larger one or the whole target vocabulary: each lm_head row of a token both vocabularies hold is
    copied, and each other row is the target's lm_head row of that token through the least-squares
    linear map that takes the target's rows to the trained draft's on the shared tokens (a start
    that ranks a new token as the target's own head would, in the draft's space). When the
    vocabularies differ, train prints and meta.json's inputs.init_from.vocab records how many rows
    were copied and how many are new (the same vocabulary is a plain copy, as with same)."""
    init_head: str = "random"
    """How a draft that starts without train.init_from begins its lm_head. random: PyTorch's default
    initialisation. target: the target's lm_head rows of the draft vocabulary's tokens (W x D), all
    scaled by one factor to the mean row norm of the random initialisation, so that the draft
    starts scoring tokens along the target's output directions without the target's confident
    logits (its rows at full scale trained worse). Experimental: in a SmolLM2-135M training its
    held-out tau_hat led a random head's by 0.15-0.19 at 1,000-2,000 steps and by ~0.05 later (one
    seed; docs/benchmarks.md). The rest of the draft starts as with random; with train.init_from
    the head is that draft's (refused together)."""
    resume: str = ""
    """auto: continue from the latest checkpoint in OUT_DIR/checkpoints if there is one; a
    checkpoint directory: continue from it; empty: start fresh (an existing run is an error). A
    checkpoint of other data, another draft vocabulary or another draft shape is refused; any other
    train setting that differs applies from the resumed step and is recorded in meta.json's `changes`
    (the lr schedule becomes this run's: a larger max_steps continues on the longer cosine)."""
    num_workers: int = -1
    """Data loader worker processes (-1 = 2 on GPU, 0 on CPU)."""
    loader_timeout_s: float = 300.0
    """With loader workers: seconds without a batch before training stops, naming the cause (a
    worker that died or could not hand its batch over, e.g. a full /dev/shm); 0 = wait forever."""
    tensorboard: bool = False
    """Also write TensorBoard events to OUT_DIR/tb (needs the tensorboard package)."""
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/train."""
    stream: StreamConfig = field(default_factory=StreamConfig)
    """train.mode=stream: engines, Ray, Mooncake store and the window of states on their way."""

    def draft_shape(self) -> dict:
        """The train.* keys that shape the draft, as DraftConfig.from_target takes them."""
        return {"num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "num_layers": self.num_layers,
                "rope_theta": self.rope_theta, "norm_before_residual": self.norm_before_residual,
                "fc_norm": self.norms == "eagle3.1", "norm_output": self.norms == "eagle3.1",
                "attention": self.draft_attention,
                "sliding_window": self.sliding_window}

    def __post_init__(self) -> None:
        # from_dict refuses inf and nan already; a TrainConfig built in code gets the same check
        for name in FLOAT_KNOBS:
            require(math.isfinite(getattr(self, name)), f"train.{name}={getattr(self, name)} must be a finite number")
        require(self.mode in MODES, f"train.mode={self.mode!r}: choose one of {', '.join(MODES)}")
        require(self.ttt_steps >= 1, f"train.ttt_steps={self.ttt_steps} must be >= 1")
        require(self.step_weight > 0, f"train.step_weight={self.step_weight} must be > 0")
        require(0.0 <= self.top1_weight <= 1.0, f"train.top1_weight={self.top1_weight} must lie in [0, 1]")
        require(self.loss in LOSSES, f"train.loss={self.loss!r}: choose one of {', '.join(LOSSES)}")
        require(self.align_top_k >= 0, f"train.align_top_k={self.align_top_k} must be >= 0 (0 = off)")
        require(self.align_norm in ALIGN_NORMS,
                f"train.align_norm={self.align_norm!r}: choose one of {', '.join(ALIGN_NORMS)}")
        require(self.align_norm == "valid" or self.align_top_k > 0,
                f"train.align_norm={self.align_norm!r} needs train.align_top_k > 0 (without it every valid position is kept)")
        require(self.init_vocab in INIT_VOCABS,
                f"train.init_vocab={self.init_vocab!r}: choose one of {', '.join(INIT_VOCABS)}")
        require(self.init_vocab == "same" or bool(self.init_from),
                f"train.init_vocab={self.init_vocab!r} needs train.init_from (a draft to remap)")
        require(self.init_head in INIT_HEADS,
                f"train.init_head={self.init_head!r}: choose one of {', '.join(INIT_HEADS)}")
        require(self.init_head == "random" or not self.init_from,
                f"train.init_head={self.init_head!r} with train.init_from: the head comes from that draft "
                "(drop one of them)")
        require(self.loss_kernel in LOSS_KERNELS,
                f"train.loss_kernel={self.loss_kernel!r}: choose one of {', '.join(LOSS_KERNELS)}")
        require(self.lr > 0, f"train.lr={self.lr} must be > 0")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"train.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        require(0.0 <= self.warmup_ratio < 1.0, f"train.warmup_ratio={self.warmup_ratio} must lie in [0, 1)")
        require(self.warmup_steps >= 0, f"train.warmup_steps={self.warmup_steps} must be >= 0")
        require(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),  # nan fails the comparison
            f"train.betas={self.betas} must be two numbers in [0, 1), e.g. --train.betas=[0.9,0.95]",
        )
        require(self.weight_decay >= 0, f"train.weight_decay={self.weight_decay} must be >= 0")
        require(self.grad_clip >= 0, f"train.grad_clip={self.grad_clip} must be >= 0 (0 = off)")
        require(self.epochs >= 1, f"train.epochs={self.epochs} must be >= 1")
        require(self.max_steps >= 0, f"train.max_steps={self.max_steps} must be >= 0")
        require(self.max_seconds >= 0, f"train.max_seconds={self.max_seconds} must be >= 0 (0 = no budget)")
        require(self.stop_by >= 0, f"train.stop_by={self.stop_by} must be >= 0 (UNIX time; 0 = no deadline)")
        require(self.max_tokens >= 8, f"train.max_tokens={self.max_tokens} is too small (>= 8)")
        require(self.grad_accum >= 1, f"train.grad_accum={self.grad_accum} must be >= 1")
        require(self.pad_multiple >= 0, f"train.pad_multiple={self.pad_multiple} must be >= 0")
        require(self.precision in PRECISIONS, f"train.precision={self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        require(self.parallel in PARALLELS, f"train.parallel={self.parallel!r}: choose one of {', '.join(PARALLELS)}")
        require(self.attention in ATTENTIONS, f"train.attention={self.attention!r}: choose one of {', '.join(ATTENTIONS)}")
        require(self.teacher_chunk >= 1, f"train.teacher_chunk={self.teacher_chunk} must be >= 1")
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            require(getattr(self, name) >= 0, f"train.{name}={getattr(self, name)} must be >= 0 (0 = the target's)")
        require(self.num_layers >= 1, f"train.num_layers={self.num_layers} must be >= 1")
        require(self.norms in NORMS, f"train.norms={self.norms!r}: choose one of {', '.join(NORMS)}")
        require(self.draft_attention in DRAFT_ATTENTIONS,
                f"train.draft_attention={self.draft_attention!r}: choose one of {', '.join(DRAFT_ATTENTIONS)}")
        if self.draft_attention == "mla":
            require(self.num_layers == 1, f"train.num_layers={self.num_layers} with --train.draft_attention=mla: an MLA "
                    "draft has one layer (set --train.num_layers=1, or --train.draft_attention=gqa)")
            for name in ("num_key_value_heads", "head_dim"):
                require(getattr(self, name) == 0, f"train.{name}={getattr(self, name)} with --train.draft_attention=mla: "
                        "MLA's key/value heads and head sizes are the target's (leave it 0)")
        require(self.sliding_window >= 0, f"train.sliding_window={self.sliding_window} must be >= 0 (0 = full attention)")
        require(self.rope_theta >= 0, f"train.rope_theta={self.rope_theta} must be >= 0 (0 = the target's)")
        require(0.0 <= self.eval_fraction < 1.0, f"train.eval_fraction={self.eval_fraction} must lie in [0, 1)")
        for name in ("eval_every", "eval_max_batches", "save_every", "keep_checkpoints"):
            require(getattr(self, name) >= 0, f"train.{name}={getattr(self, name)} must be >= 0")
        require(self.log_every >= 1, f"train.log_every={self.log_every} must be >= 1")
        require(self.collapse_steps >= 0, f"train.collapse_steps={self.collapse_steps} must be >= 0 (0 = never)")
        require(self.loader_timeout_s >= 0, f"train.loader_timeout_s={self.loader_timeout_s} must be >= 0 (0 = none)")
        require(self.num_workers >= -1, f"train.num_workers={self.num_workers} must be >= 0 (or -1 = auto)")
        require(self.target_group_tokens >= 0,
                f"train.target_group_tokens={self.target_group_tokens} must be >= 0 (0 = one forward per batch)")
