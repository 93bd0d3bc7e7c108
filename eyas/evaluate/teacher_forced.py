"""The teacher-forced check: the chain (and tree) decoder simulated from the draft's training-time
forward on the target's greedy outputs (eyas.spec.simulate), compared pass by pass with the
decoders' measured passes where they produced the same output."""

from __future__ import annotations

import time
from typing import Any

import torch

from eyas.errors import EyasError, exception_message
from eyas.spec import SpecStats


@torch.no_grad()
def teacher_forced_chain(
    target, draft, k: int, ref_runs: list[dict[str, Any]], chain_runs: list[dict[str, Any]] | None,
    tree: tuple[int, int, int] | None = None, tree_runs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The greedy chain decoder with k drafts simulated on the greedy outputs of `ref_runs`
    (eyas.spec.simulate): per prompt one plain target forward (aux states, eyas.capture) and one
    TTT forward of the draft over prompt + output. acc[i]: TTT step i's top-1 == the output token
    it predicts, over every output token (as training's acc_T); tau_hat from acc as training logs
    it; tau_sim etc.: the simulated passes, pooled (a pass running past a prompt's output counts
    its lower bound); `prompts`: each prompt's simulated passes and tokens, for splits by turn.
    Where chain_runs[i] decoded the same prompt into the same output, its measured passes are
    compared with the simulated ones (`SimulatedChain.matches`); chain_runs None
    (evaluate.mode=simulate): nothing to compare. `tree` = (total_tokens, depth, top_k): the greedy
    tree decoder simulated too (eyas.spec.simulate.simulate_tree, from the same aux states), under
    "tree", compared with `tree_runs` the same way."""
    from eyas.capture import capture
    from eyas.spec.simulate import label_mask, simulate_chain, simulate_tree, teacher_forced_steps
    from eyas.train.loss import acceptance_length

    t0 = time.perf_counter()
    device = target.get_input_embeddings().weight.device
    layer_ids = list(draft.config.aux_layer_ids)
    correct_T = torch.zeros(k, dtype=torch.long, device=device)
    valid_T = torch.zeros(k, dtype=torch.long, device=device)
    chain, trees, tree_s = _SimulatedPasses(), _SimulatedPasses(), 0.0
    none = [None] * len(ref_runs)
    for ref, run, trun in zip(ref_runs, chain_runs or none, tree_runs or none):
        start = len(ref["prompt_ids"])
        ids_S = torch.tensor(ref["prompt_ids"] + ref["gen"].tokens, device=device)
        try:
            aux_1SKD, _ = capture(target, ids_S[None], layer_ids=layer_ids)
            correct_TS = teacher_forced_steps(draft, aux_1SKD[0], ids_S, k, first_label=start)
            if tree is not None:
                tt = time.perf_counter()
                sim = simulate_tree(draft, aux_1SKD[0], ids_S, start, ids_S.shape[0],
                                    top_k=tree[2], depth=tree[1], total_tokens=tree[0])
                trees.add(sim, ref, trun)
                tree_s += time.perf_counter() - tt
        except Exception as e:  # which prompt: the caller records type, message and the chained traceback
            raise EyasError(f"question {ref['id']} turn {ref['turn']} ({ids_S.shape[0]} tokens): "
                            f"{type(e).__name__}: {exception_message(e)}") from e
        correct_T += correct_TS.sum(1)
        valid_T += label_mask(k, ids_S.shape[0], start, device).sum(1)
        chain.add(simulate_chain(correct_TS, start, ids_S.shape[0], k), ref, run)  # one host copy per prompt
    acc = (correct_T / valid_T.clamp(min=1)).tolist()
    return {
        "outputs": "chain" if ref_runs is chain_runs else "tree" if ref_runs is tree_runs else "target_only",
        "num_draft_tokens": k,
        "num_prompts": len(ref_runs),
        "acc": acc,
        "num_positions": valid_T.tolist(),
        "tau_hat": acceptance_length(acc),
        **chain.fields(),
        "tree": None if tree is None else {
            "tree_total_tokens": tree[0], "tree_depth": tree[1], "tree_top_k": tree[2], **trees.fields(),
            "wall_s": tree_s,
        },
        "wall_s": time.perf_counter() - t0,
    }


class _SimulatedPasses:
    """One simulated decoder's passes pooled over prompts, and where a decoder produced the same
    output for a prompt, whether its measured passes are the simulated ones (`matches`)."""

    def __init__(self) -> None:
        self.pooled, self.compared, self.mismatches, self.prompts = SpecStats(), 0, [], []

    def add(self, sim, ref: dict[str, Any], run: dict[str, Any] | None) -> None:
        stats = sim.stats()
        self.pooled.merge(stats)
        self.prompts.append({"id": ref["id"], "turn": ref["turn"], "verify_passes": stats.verify_passes,
                             "new_tokens": stats.new_tokens})
        if run is not None and run["prompt_ids"] == ref["prompt_ids"] and run["gen"].tokens == ref["gen"].tokens:
            self.compared += 1
            if not sim.matches(run["gen"].stats):
                self.mismatches.append({"id": run["id"], "turn": run["turn"], "simulated": sim.accepted,
                                        "last_is_lower_bound": sim.last_is_lower_bound,
                                        "decoder_histogram": list(run["gen"].stats.accept_counts)})

    def fields(self) -> dict[str, Any]:
        return {
            "tau_sim": self.pooled.tau,
            "verify_passes": self.pooled.verify_passes,
            "acceptance_per_position": self.pooled.acceptance_per_position(),
            "accept_length_histogram": list(self.pooled.accept_counts),
            "num_compared": self.compared,
            "num_matching": self.compared - len(self.mismatches),
            "matches_decoder": not self.mismatches if self.compared else None,
            "mismatches": self.mismatches,
            "prompts": self.prompts,
        }
