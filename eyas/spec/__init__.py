"""Speculative decoding with an EAGLE-3 draft: chain and EAGLE-2 dynamic-tree drafting, target
verification in one forward, greedy and sampling acceptance, KV-cache bookkeeping.

    from eyas.spec import speculative_generate, target_generate
    out = speculative_generate(target, draft, prompt_ids, max_new_tokens=128, mode="tree")
    out.tokens, out.stats.tau, out.stats.accept_counts

Modules: sampling (acceptance maths), tree (tree layout, EAGLE-2 selection, tree acceptance),
cache (target/draft KV caches), propose (draft chain/tree), verify (target forwards with aux
states), generate (the loop and the target-only baseline).
"""

from eyas.spec.generate import Generation, SpecParams, SpecStats, speculative_generate, target_generate
from eyas.spec.tree import Tree, chain_tree

__all__ = [
    "Generation",
    "SpecParams",
    "SpecStats",
    "Tree",
    "chain_tree",
    "speculative_generate",
    "target_generate",
]
