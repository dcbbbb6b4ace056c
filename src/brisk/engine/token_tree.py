"""Token trees: drafts that branch, verified by the target in one forward with a tree attention mask.

A tree draft for a request whose last token is r (the root, not yet in the cache) is a list of tokens x_0..x_{N-1}
and their parents: parent[i] is another draft's index (always < i) or -1 for the root. The step computes the
root and all N drafts as one chunk of N + 1 rows:

    rows:       | r | x_0 | x_1 | ... | x_{N-1} |
    positions:  | p | p + depth(x_0) | ...        (depth of a child of the root = 1)
    cache:      | p | p + 1 | p + 2 | ... | p + N |  (rows take consecutive cache entries, as any chunk)

and each row attends to the request's earlier cache and to its own ancestors and itself only (`tree_mask`), so
row i's logits are the target's distribution after the root-to-x_i path, exactly as if that path alone had been
decoded (tested against that in tests/test_spec_tree.py).

Greedy verification (`accept_tree_greedy`) walks from the root: while some child of the current node carries the
target's argmax at that node, step into it. The emitted tokens are the accepted path's drafts plus the argmax at
its last node, which is plain greedy decoding token for token. Sampled requests (`accept_tree_sampling`) try a
node's candidates in turn, each as a point-mass draft against what the earlier rejections left of the target's
distribution (recursive rejection sampling), so their output is distributed exactly as the target's. The accepted
nodes' K/V then moves from their tree entries to p + 1, p + 2, ... (`accepted_moves`); entries past the path are
left to be overwritten and their blocks freed by the scheduler, as for rejected chain drafts.

Static trees (`static_tree`): Medusa's choice of paths. A path (c_1, ..., c_d) takes the c_k-th ranked candidate
of head k at depth k; with a_k(c) the measured probability that head k's rank-c candidate is the target's token,
a path is accepted with probability about prod_k a_k(c_k). The N paths of highest product form the tree; a prefix
has at least its extension's product, so the set is closed under prefixes, and ordered by decreasing product
every parent comes before its children and the first n nodes are the best n-node tree (adaptive tree size).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from brisk.engine.sampler import SamplingMetadata
from brisk.engine.sampling_params import SAMPLING_EPS
from brisk.engine.verify import draw_token, probs_from_processed, processed_logits, uniform


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each draft (a child of the root has depth 1)."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        assert -1 <= p < i, f"draft {i}'s parent {p} must be an earlier draft or -1 (the root)"
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def tree_mask(parents: Sequence[int], num_real: int = 1) -> torch.Tensor:
    """[num_real + N, num_real + N] bool over a chunk of num_real ordinary tokens (causal among themselves)
    followed by the N drafts: each draft sees every real token, its ancestors and itself."""
    n = len(parents)
    size = num_real + n
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[:num_real, :num_real] = torch.ones(num_real, num_real, dtype=torch.bool).tril()
    mask[num_real:, :num_real] = True
    for i, p in enumerate(parents):
        row = num_real + i
        if p >= 0:
            mask[row] = mask[num_real + p]
        mask[row, row] = True
    return mask


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The drafts from the root's child down to `node` (indices), or [] for the root (-1)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """node -> its children's indices in draft order (-1: the root, whose children are the first-level drafts)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    return children


def accept_tree_greedy(tokens: Sequence[int], parents: Sequence[int], argmax: Sequence[int]
                       ) -> tuple[list[int], list[int]]:
    """(accepted drafts' indices root to leaf, emitted tokens). argmax[0] is the target's argmax at the root,
    argmax[1 + i] at draft i; emitted = the accepted drafts' tokens + the argmax at the last accepted node."""
    assert len(argmax) == len(tokens) + 1 == len(parents) + 1
    children = children_of(parents)
    path: list[int] = []
    node = -1
    while True:
        want = int(argmax[node + 1])
        nxt = next((c for c in children.get(node, ()) if tokens[c] == want), None)
        if nxt is None:
            return path, [tokens[i] for i in path] + [want]
        path.append(nxt)
        node = nxt


def accepted_moves(path: Sequence[int]) -> list[tuple[int, int]]:
    """(from, to) offsets after the root's cache entry: accepted draft i sits at root + 1 + i and belongs at
    root + depth. Ascending, and every source lies at or after its destination, so copying in order is safe."""
    return [(1 + node, d) for d, node in enumerate(path, start=1) if 1 + node != d]


def static_tree(accuracy: Sequence[Sequence[float]], size: int) -> list[tuple[int, ...]]:
    """The `size` paths of highest estimated acceptance, best first (parents before children).

    accuracy[k][c]: probability that head k's rank-c candidate is the target's token (depth k + 1)."""
    depth_max = len(accuracy)
    if size < 1 or depth_max == 0:
        return []
    out: list[tuple[int, ...]] = []
    # best-first search: a path's children have at most its probability, so popping in order yields the top ones
    heap: list[tuple[float, int, tuple[int, ...]]] = [(-float(accuracy[0][c]), 1, (c,)) for c in
                                                      range(len(accuracy[0]))]
    heapq.heapify(heap)
    while heap and len(out) < size:
        neg, _, path = heapq.heappop(heap)
        out.append(path)
        d = len(path)
        if d < depth_max:
            for c in range(len(accuracy[d])):
                heapq.heappush(heap, (neg * float(accuracy[d][c]), d + 1, (*path, c)))
    return out


def tree_parents(paths: Sequence[tuple[int, ...]]) -> list[int]:
    """Each path's parent: the index of its prefix among `paths` (-1 for a depth-1 path)."""
    index = {p: i for i, p in enumerate(paths)}
    parents = []
    for i, p in enumerate(paths):
        parent = -1 if len(p) == 1 else index[p[:-1]]
        assert parent < i, f"path {p} comes before its prefix"
        parents.append(parent)
    return parents


def accept_tree_sampling(tokens: Sequence[int], parents: Sequence[int], probs: torch.Tensor,
                         generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Exact multi-draft speculative sampling down a token tree: (accepted drafts' indices root to leaf, emitted
    tokens). probs [1 + N, V]: the processed target distribution at the root (row 0) and after each draft i
    (row 1 + i).

    At a node with candidate children c_1..c_m (the proposer's order, best first) and target distribution p, each
    candidate is a point-mass draft of its own, tried in turn against what the earlier rejections left of p
    (recursive rejection sampling, SpecInfer / Miao et al. 2024, with deterministic candidates):

        r = p
        for c in c_1..c_m:
            accept c with probability r(x_c) / sum(r)        -> step into c, repeat there with p = probs[c]
            else r(x_c) = 0                                  (the residual of a point mass: x_c removed)
        none accepted: emit y ~ r / sum(r), stop

    Each try is one rejection step of Leviathan et al.'s Algorithm 1 whose target is the current residual and whose
    draft is a point mass, so the token leaving a node is distributed exactly as that residual, which by induction
    is p itself: the emitted sequence is distributed as sampling from the target token by token (tested
    statistically in tests/test_spec_tree.py). A candidate repeated among its siblings meets a residual that is 0
    at its token and is never accepted twice."""
    assert probs.shape[0] == len(tokens) + 1 == len(parents) + 1
    children = children_of(parents)
    path: list[int] = []
    node = -1
    while True:
        residual = probs[node + 1].clone()  # [V]
        nxt = None
        for c in children.get(node, ()):
            x = tokens[c]
            mass = float(residual.sum())
            if mass > 0.0 and uniform(generator) * mass < float(residual[x]):
                nxt = c
                break
            residual[x] = 0.0
        if nxt is None:
            # all mass on rejected candidates happens only through rounding (each would have been accepted
            # with probability 1): the node's own distribution is the exact limit
            last = residual if float(residual.sum()) > 0.0 else probs[node + 1]
            return path, [tokens[i] for i in path] + [draw_token(last, generator)]
        path.append(nxt)
        node = nxt


def verify_tree(logits: torch.Tensor, requests: Sequence, drafts: Sequence[list[int]],
                parents: Sequence[list[int]]) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Verification of token trees: logits [R, V] hold 1 + len(drafts[j]) rows per request j (root, then drafts).
    Returns per request (accepted draft indices, emitted tokens, the rows of the emitted tokens).

    Every row is processed as the sampler would process it at that position (min_tokens ban and penalties with
    the root-to-node path counted as generated, as engine/verify.py position_metadata does for a chain); greedy
    requests then walk the argmax (`accept_tree_greedy`), sampled ones take the rest of the sampler's pipeline
    (temperature, min_p, top-k, top-p) and `accept_tree_sampling` with the request's own generator."""
    params, outputs, prompts, eos, gens = [], [], [], [], {}
    for req, draft, par in zip(requests, drafts, parents, strict=True):
        for node in range(-1, len(draft)):
            if req.generator is not None:
                gens[len(params)] = req.generator
            params.append(req.sampling_params)
            outputs.append(req.output_token_ids + [draft[i] for i in path_to(par, node)])
            prompts.append(req.prompt_token_ids)
            eos.append(req.eos_token_ids)
    meta = SamplingMetadata.from_params(params, outputs, prompts, gens, vocab_size=logits.shape[1],
                                        eos_token_ids=eos, device=logits.device)
    penalized = processed_logits(logits, meta)  # [R, V]
    argmax = penalized.argmax(dim=-1).tolist()
    probs = None if meta.all_greedy else probs_from_processed(penalized, meta)  # [R, V]
    paths, tokens, rows = [], [], []
    start = 0
    for req, draft, par in zip(requests, drafts, parents, strict=True):
        n = len(draft) + 1
        if req.sampling_params.temperature < SAMPLING_EPS:
            path, emitted = accept_tree_greedy(draft, par, argmax[start:start + n])
        else:
            assert probs is not None
            path, emitted = accept_tree_sampling(draft, par, probs[start:start + n], req.generator)
        paths.append(path)
        tokens.append(emitted)
        rows.append([start] + [start + 1 + i for i in path])
        start += n
    return paths, tokens, rows
