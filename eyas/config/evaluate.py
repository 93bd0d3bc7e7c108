from __future__ import annotations

import re
from dataclasses import dataclass, field

from eyas.config.base import require

MODES = ("chain", "tree", "both", "simulate")
BACKENDS = ("hf", "vllm")
DTYPES = ("", "auto", "bfloat16", "float16", "float32")


@dataclass
class EvaluateConfig:
    draft: str = ""
    """The draft to evaluate: eyas's own checkpoint (a directory with draft_config.json, as the
    trainer writes) or an exported vLLM/SGLang directory; empty = the train stage's final/ (in
    train.out_dir, else RUN_DIR/train), or the export output when export.average_with is set (the
    exported draft is then the mean, not train's)."""
    bench: str = "mtbench"
    """Prompts: `mtbench` (the 80 MT-bench questions, 2 turns each; the second turn follows the
    model's own first answer) or a JSONL file with one {"turns": [...]}, {"prompt": "..."} or
    JSON string per line."""
    num_questions: int = 0
    """Use the first N questions of the bench (0 = all)."""
    max_new_tokens: int = 256
    """New tokens per turn (generation also stops at the target's end-of-turn tokens)."""
    mode: str = "chain"
    """chain (num_draft_tokens tokens per step), tree (EAGLE-2 dynamic tree), both, or simulate:
    no speculative decoding, only target-only greedy decoding (whatever measure_speedup and
    lossless_check say) and the chain decoder simulated from the draft's teacher-forced forward on
    its outputs (`teacher_forced`; results.json `tau_chain_simulated`; with `simulate_tree` the tree
    decoder's too, `tau_tree_simulated`): greedy only, no speedup, no lossless check; the chain and
    tree decoding time saved. In float32 its passes are the chain decoder's; in bf16 an argmax may
    flip where two logits nearly tie, and it reads a little low (each prompt's last pass counts
    its lower bound)."""
    num_draft_tokens: int = 7
    """Chain mode: draft tokens proposed per verify pass."""
    tree_total_tokens: int = 60
    """Tree mode: draft nodes kept per tree (root excluded); one verify forward feeds them + the root."""
    tree_depth: int = 8
    """Tree mode: most draft tokens on one root-to-leaf path."""
    tree_top_k: int = 10
    """Tree mode: children per expanded node, and nodes expanded per level."""
    temperature: float = 0.0
    """0 = greedy (exact: output equal to the target's greedy output); > 0 = speculative sampling
    at this temperature (the output distribution is the target's at that temperature). Trees
    under sampling use point-mass proposals (see docs/evaluate.md)."""
    seed: int = -1
    """Seed of the sampling RNG; -1 = the top-level seed."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N."""
    dtype: str = ""
    """Weights/activations dtype of target and draft; empty = target.dtype (auto: bf16 on GPU, fp32 on CPU)."""
    lossless_check: bool = True
    """Under greedy: compare every speculative output with target-only greedy decoding token for
    token (ignored when temperature > 0). At each first difference a plain forward of the target
    (no cache) scores the two tokens the decoders chose; a difference is a near-tie when their
    logits are within `tie_tolerance` (relative), the numerics of a multi-token verify against a
    one-token decode in bf16/fp16. Any other difference fails the run."""
    tie_tolerance: float = -1.0
    """Relative logit gap below which a greedy difference counts as a near-tie (see
    lossless_check), relative to the top of the larger logit's binade (the power of two just above
    its magnitude, so at least 2); -1 = by dtype: 2^-6 for bfloat16, 2^-9 for float16 (four units in
    the last place anywhere in the binade), 1e-4 for float32."""
    measure_speedup: bool = True
    """Time target-only decoding on the same prompts and device (warm-up excluded) and report the
    wall-clock speedup. Under greedy with lossless_check the baseline runs anyway."""
    teacher_forced: bool = True
    """Greedy with a chain mode (or simulate, which needs it): after decoding, run the draft
    teacher-forced (its training-time forward) on the target-only outputs and report per-step
    accuracy as training measures it, tau_hat, and the chain decoder simulated from it, compared
    with the measured chain's accepted-length histogram and per-position counts (results.json
    `teacher_forced`; see eyas/spec/simulate.py). One target forward and one draft TTT forward per
    prompt."""
    simulate_tree: bool = True
    """With `teacher_forced`, in mode tree, both or simulate: also the greedy EAGLE-2 tree decoder
    (tree_total_tokens, tree_depth, tree_top_k) simulated pass by pass on the same outputs
    (eyas.spec.simulate.simulate_tree: the real draft tree per pass, the target's verify replaced by
    the known output), compared with the measured tree's passes where it decoded the same output;
    results.json `teacher_forced.tree` and `tau_tree_simulated`. It runs the draft's tree once per
    verify pass: on CPU, minutes for MT-bench's 160 prompts."""
    cuda_graphs: bool = True
    """On CUDA: fixed-size KV caches and CUDA graphs for the target's verify/decode forwards, the
    draft's step 0 and its greedy chain (eyas/spec/static.py), for target-only decoding too.
    Without them every forward pays hundreds of kernel launches. false = transformers'
    DynamicCache, eagerly (the reference path; always used on CPU)."""
    max_context: int = 4096
    """Static caches: slots per sequence (prompt + new tokens + one round's drafts); a longer
    generation fails naming this key."""
    target_outputs: str = ""
    """Mode simulate: the target-only greedy outputs of an earlier evaluation (its
    target_outputs.json, or the directory holding it) instead of decoding them again, so only this
    draft's teacher-forced pass runs (on a CPU, decoding is most of an evaluation's time). They must come from the same target (name, revision and, for an embedded one, its
    file's sha256; a local path's weights are not hashed), dtype, device type (on CUDA also
    cuda_graphs), bench file, questions and max_new_tokens, checked before any model loads, and
    every prompt is rendered again from them and compared. Every greedy evaluation that decodes
    target-only writes that file."""
    context_tokens: int = 0
    """N > 0: a long-context evaluation. Ahead of each question's first turn go earlier turns of real
    conversations (user/assistant pairs of the embedded ShareGPT, in file order, none used twice),
    as many as it takes for that first prompt to render to at least N tokens; later turns keep
    them. It measures a draft on contexts longer than its training rows or its sliding window
    (train.sliding_window): run once with 0 and once with N and compare tau_chain / tau_tree (each
    run's results.json `settings.context_tokens` says which). 0 = the bench's prompts alone."""
    max_seconds: float = 0.0
    """Wall-clock budget of the decoding (0 = none). Questions are taken in order, each decoded by
    every decoder (target-only, chain, tree) before the next; after the first, no question is
    started when the time used plus the longest question so far would exceed the budget. The
    results say how many questions were evaluated (`num_questions`, `stopped_early`)."""
    backend: str = "hf"
    """hf: target and draft in this process (eyas.spec: chain, tree, the teacher-forced check, CUDA
    graphs). vllm: vLLM serves the draft behind the target (its EAGLE-3 chain, num_draft_tokens per
    step; tensor / expert parallel below), then the target alone as the baseline, and tau,
    acceptance per position, speedup and the lossless check come from vLLM's outputs and counters
    (eyas/evaluate/vllm.py; run eyas from a venv with vLLM). Mode chain only."""
    vllm_tensor_parallel_size: int = 1
    """backend vllm: GPUs (or CPU workers) the target is split over (vLLM `tensor_parallel_size`)."""
    vllm_enable_expert_parallel: bool = False
    """backend vllm: shard MoE experts instead of tensor-splitting them (vLLM `enable_expert_parallel`)."""
    vllm_gpu_memory_utilization: float = 0.9
    """backend vllm: fraction of each GPU vLLM may take."""
    vllm_engine_args: dict = field(default_factory=dict)
    """backend vllm: any other `vllm.LLM(...)` keyword arguments, applied last to both engines."""
    out_dir: str = ""
    """Output directory; empty = RUN_DIR/evaluate."""

    def __post_init__(self) -> None:
        require(self.max_context >= 16, f"evaluate.max_context={self.max_context} must be >= 16")
        require(self.context_tokens >= 0, f"evaluate.context_tokens={self.context_tokens} must be >= 0 (0 = none)")
        require(self.max_seconds >= 0, f"evaluate.max_seconds={self.max_seconds} must be >= 0 (0 = no budget)")
        require(self.tie_tolerance == -1 or 0 <= self.tie_tolerance <= 0.1,
                f"evaluate.tie_tolerance={self.tie_tolerance}: a relative logit gap in [0, 0.1], or -1 (by dtype)")
        require(bool(self.bench), "evaluate.bench is empty: give `mtbench` or a JSONL file of prompts")
        require(self.num_questions >= 0, f"evaluate.num_questions={self.num_questions} must be >= 0 (0 = all)")
        require(self.max_new_tokens >= 1, f"evaluate.max_new_tokens={self.max_new_tokens} must be >= 1")
        require(self.mode in MODES, f"evaluate.mode={self.mode!r}: choose one of {', '.join(MODES)}")
        require(self.num_draft_tokens >= 1, f"evaluate.num_draft_tokens={self.num_draft_tokens} must be >= 1")
        require(self.tree_total_tokens >= 1, f"evaluate.tree_total_tokens={self.tree_total_tokens} must be >= 1")
        require(self.tree_depth >= 1, f"evaluate.tree_depth={self.tree_depth} must be >= 1")
        require(self.tree_top_k >= 1, f"evaluate.tree_top_k={self.tree_top_k} must be >= 1")
        require(self.temperature >= 0, f"evaluate.temperature={self.temperature} must be >= 0 (0 = greedy)")
        require(self.mode != "simulate" or (self.temperature == 0 and self.teacher_forced),
                f"evaluate.mode=simulate simulates greedy chain decoding from the teacher-forced forward: it needs "
                f"evaluate.temperature=0 (not {self.temperature:g}) and evaluate.teacher_forced=true "
                f"(not {str(self.teacher_forced).lower()}); use mode chain, tree or both otherwise")
        require(not self.target_outputs or self.mode == "simulate",
                f"evaluate.target_outputs is read by evaluate.mode=simulate only (not {self.mode!r}): the other "
                f"modes decode and time the target-only baseline beside their own decoding")
        require(self.seed >= -1, f"evaluate.seed={self.seed} must be >= 0, or -1 for the top-level seed")
        require(
            self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device) is not None,
            f"evaluate.device={self.device!r}: choose auto, cpu, cuda or cuda:N",
        )
        require(self.backend in BACKENDS, f"evaluate.backend={self.backend!r}: choose one of {', '.join(BACKENDS)}")
        require(self.backend == "hf" or self.mode == "chain",
                f"evaluate.mode={self.mode!r} with evaluate.backend=vllm: vLLM decodes EAGLE-3 chains; trees and "
                "simulate need --evaluate.backend=hf")
        require(self.backend == "hf" or not self.target_outputs,
                "evaluate.target_outputs is read by the in-process evaluator (--evaluate.backend=hf) only")
        require(self.vllm_tensor_parallel_size >= 1,
                f"evaluate.vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} must be >= 1")
        require(0 < self.vllm_gpu_memory_utilization <= 1,
                f"evaluate.vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must lie in (0, 1]")
        require(
            self.dtype in DTYPES,
            f"evaluate.dtype={self.dtype!r}: choose auto, bfloat16, float16, float32 or empty (= target.dtype)",
        )
