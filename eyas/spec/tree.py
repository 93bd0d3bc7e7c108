"""Draft trees: the EAGLE-2 node selection, tree attention masks and tree acceptance (pure).

Legend: N tree nodes including the root (node 0), M candidate nodes, V target vocab.

A `Tree` is verified by ONE target forward over its N nodes laid out flat in node order: node 0
is the root (the last committed token, not yet in the target's KV cache) and every parent comes
before its children. Node i sits at sequence position (root position + depth[i]) and attends to
the whole committed prefix plus its own ancestors and itself (`ancestor_mask`); so node i's
logits are the target's logits after the path root -> i, exactly as in a chain.

A chain of K draft tokens is the tree with parents [-1, 0, 1, ..., K-1] (`chain_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.spec.sampling import logits_to_probs, sample


@dataclass
class Tree:
    tokens: list[int]
    """Target token id of each node; tokens[0] is the root."""
    parents: list[int]
    """Parent node of each node; parents[0] = -1 (the root)."""
    depths: list[int]
    """Depth of each node (root 0): its position is root position + depth."""
    scores: list[float] | None = None
    """Draft cumulative log-prob of the path to each node (root 0.0); None for hand-made trees."""

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents) == len(self.depths) and self.parents[0] == -1
        assert all(0 <= p < i and self.depths[i] == self.depths[p] + 1 for i, p in enumerate(self.parents) if i), (
            "parents must precede children, one level apart"
        )

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], 1):
            out[p].append(i)
        return out


def chain_tree(root: int, draft_tokens: list[int]) -> Tree:
    """The tree that is a chain: root -> draft_tokens[0] -> draft_tokens[1] -> ..."""
    n = len(draft_tokens)
    return Tree([root, *draft_tokens], list(range(-1, n)), list(range(n + 1)))


def ancestor_mask(parents: list[int], device=None) -> torch.Tensor:
    """bool [N, N]: mask[i, j] = node j is node i or one of its ancestors (what node i attends to)."""
    n = len(parents)
    mask_NN = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask_NN[i] |= mask_NN[p]  # p < i: its row is already complete
    return mask_NN.to(device)


def select_nodes(
    root: int,
    cand_tokens_M: list[int],
    cand_parents_M: list[int],
    cand_scores_M: torch.Tensor,
    cand_depths_M: list[int],
    total_tokens: int,
) -> Tree:
    """EAGLE-2 reranking: keep the `total_tokens` candidates of highest cumulative log-prob.

    Candidates come level by level (a parent's index is below its children's; parent -1 = the root).
    A child's score is its parent's plus a log-prob <= 0, so it is never above its parent's; a
    stable descending sort therefore lists every parent before its children (ties go to the lower
    index, the parent), and any top-n of it is a tree closed under ancestors.
    """
    order_M = torch.sort(cand_scores_M.float().cpu(), descending=True, stable=True).indices
    keep = sorted(order_M[:total_tokens].tolist())
    node_of = {c: i + 1 for i, c in enumerate(keep)}  # candidate index -> node index (root = 0)
    node_of[-1] = 0
    parents = [-1] + [node_of[cand_parents_M[c]] for c in keep]  # KeyError = a parent was dropped (bug)
    scores = cand_scores_M.float().cpu().tolist()
    return Tree(
        [root] + [cand_tokens_M[c] for c in keep],
        parents,
        [0] + [cand_depths_M[c] for c in keep],
        [0.0] + [scores[c] for c in keep],
    )


def accept_greedy_tree(tree: Tree, target_argmax_N: torch.Tensor) -> tuple[list[int], int]:
    """-> (accepted path: node indices below the root, the token emitted after it).

    From the root, follow the child whose token is the target's argmax at the current node
    (target_argmax_N[i] = argmax after the path root -> i); stop where no child holds it and emit
    that argmax. Sibling tokens are distinct, so the walk is unique.
    """
    argmax = target_argmax_N.tolist()  # host sync: the walk branches on every value
    kids = tree.children()
    path, node = [], 0
    while True:
        nxt = [c for c in kids[node] if tree.tokens[c] == argmax[node]]
        if not nxt:
            return path, argmax[node]
        node = nxt[0]
        path.append(node)


def accept_sampling_tree(
    tree: Tree, logits_NV: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Lossless sampling over a tree whose children are chosen deterministically (top-k).

    At the current node draw y ~ p(. | path); move to the child holding y if there is one, else
    stop and emit y. Every emitted token is thus a draw from the target's p given the tokens before
    it: the output distribution is the target's. This is the recursive rejection rule with
    point-mass proposals (candidate x_j has q = delta_{x_j}): accept x_1 with probability
    min(1, p(x_1)/1) = p(x_1); on rejection the residual norm(max(0, p - delta_{x_1})) is p without
    x_1, renormalised; candidate x_2 is then accepted with p(x_2)/(1 - p(x_1)), and so on, which
    gives each child exactly probability p(x_j) and the final residual draw the rest of p.
    """
    kids = tree.children()
    path, node = [], 0
    while True:
        y = int(sample(logits_to_probs(logits_NV[node], temperature), generator).item())  # host sync per level
        nxt = [c for c in kids[node] if tree.tokens[c] == y]
        if not nxt:
            return path, y
        node = nxt[0]
        path.append(node)
