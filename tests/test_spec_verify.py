"""The verifier: hand-computed acceptance cases, consistency with the engine's sampler, and statistical tests
that speculative sampling, on chains and on token trees, reproduces the target distribution."""

from __future__ import annotations

import math

import torch

from brisk.engine.request import Request
from brisk.engine.sampler import Sampler, SamplingMetadata
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.token_tree import accept_tree_sampling, verify_tree
from brisk.engine.verify import accept, accept_greedy, verify


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- hand cases

def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    assert accept_greedy([3, 5, 7], [3, 5, 2, 9]) == [3, 5, 2]  # mismatch at 3rd: the target's 2
    assert accept_greedy([3, 5, 7], [3, 5, 7, 9]) == [3, 5, 7, 9]  # all accepted: bonus 9
    assert accept_greedy([4], [3, 1]) == [3]
    assert accept_greedy([], [6]) == [6]  # no drafts: a plain step


def test_draft_the_target_cannot_produce_is_replaced_by_the_residual():
    # p = one-hot(2), q = one-hot(1): p(1)/q(1) = 0, rejected; residual max(0, p - q) = one-hot(2)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert accept([1], t([0, 1, 0]), t([0, 0, 1], [1, 0, 0]), g) == [2]


def test_equal_distributions_accept_everything_and_draw_the_bonus():
    # p == q: r * q(x) < p(x) for every r in [0, 1): all accepted; the bonus row is one-hot(0)
    g = torch.Generator().manual_seed(0)
    p = t([0.2, 0.3, 0.5])[0]
    for _ in range(20):
        out = accept([2, 1], torch.stack([p, p]), torch.stack([p, p, t([1, 0, 0])[0]]), g)
        assert out == [2, 1, 0]


def test_point_mass_draft_accepted_with_target_probability():
    # q = one-hot(x): accept with p(x) = 0.3; on rejection the residual is p without x: token 1
    g = torch.Generator().manual_seed(1)
    outs = [tuple(accept([0], None, t([0.3, 0.7], [0.0, 1.0]), g)) for _ in range(4000)]
    assert set(outs) == {(0, 1), (1,)}
    frac = outs.count((0, 1)) / len(outs)
    # binomial sd = sqrt(0.3 * 0.7 / 4000) = 0.0072; 5 sd is a 6e-7 false-failure chance
    assert abs(frac - 0.3) < 5 * 0.0072


def test_draft_rarer_under_target_accepted_with_ratio():
    # p = [0.2, 0.8], q = [0.8, 0.2], draft 0: accept with p/q = 0.25; residual max(0, p - q)
    # = [0, 0.6] -> token 1 on every rejection
    g = torch.Generator().manual_seed(2)
    outs = [tuple(accept([0], t([0.8, 0.2]), t([0.2, 0.8], [0.5, 0.5]), g)[:1]) for _ in range(4000)]
    frac = outs.count((0,)) / len(outs)
    assert abs(frac - 0.25) < 5 * math.sqrt(0.25 * 0.75 / 4000)
    assert set(outs) == {(0,), (1,)}


# ---------------------------------------------------------------------------------- consistency with the sampler

def make_request(params: SamplingParams, prompt: list[int], outputs: list[int], seed: int | None = None) -> Request:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    req = Request("r", prompt, params, eos_token_ids=(0,), generator=gen)
    req.append_output_token_ids(outputs)
    return req


def test_greedy_verify_equals_plain_decoding_with_penalties_and_min_tokens():
    """Drafts = what plain greedy decoding (the engine's Sampler) emits position by position, with penalties and
    a min_tokens ban in force: verify must accept them all and add the Sampler's next token as the bonus; a
    wrong draft must be replaced by exactly the Sampler's token."""
    torch.manual_seed(0)
    vocab = 12
    params = SamplingParams(temperature=0, repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4,
                            min_tokens=6, max_tokens=50)
    # logits with strong repeats of a few ids, so the penalties change the argmax
    logits = torch.randn(5, vocab) + torch.tensor([4.0, 3.5, 3.4, 3.3] + [0.0] * (vocab - 4))
    req = make_request(params, [1, 2, 3], [2])
    plain: list[int] = []
    for i in range(5):
        meta = SamplingMetadata.from_params([params], [req.output_token_ids + plain], [req.prompt_token_ids],
                                            vocab_size=vocab, eos_token_ids=[(0,)])
        plain.append(Sampler()(logits[i:i + 1], meta).sampled_token_ids[0])
    assert len(set(plain)) > 1  # the penalties did move the argmax around
    assert verify(logits, [req], [plain[:4]], [None]).token_ids == [plain]
    wrong = list(plain[:4])
    wrong[2] = (wrong[2] + 1) % vocab
    assert verify(logits, [req], [wrong], [None]).token_ids == [plain[:3]]


# ------------------------------------------------------------------------------------------ statistical test

VOCAB = 4
P1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
P_NEXT = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.1, 0.3, 0.5]])
Q1 = torch.tensor([0.4, 0.3, 0.2, 0.1])
Q_NEXT = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.3, 0.3, 0.3, 0.1], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])


def generate_three(rule, g: torch.Generator, gamma: int = 2) -> tuple[int, ...]:
    """Three tokens from a Markov 'model' (p_1 then p(.|previous)) by repeated speculation with a Markov draft."""
    out: list[int] = []
    while len(out) < 3:
        prev = out[-1] if out else None
        drafts, qs, ps = [], [], []
        for _ in range(gamma):
            q = Q1 if prev is None else Q_NEXT[prev]
            p = P1 if prev is None else P_NEXT[prev]
            x = int(torch.multinomial(q, 1, generator=g))
            drafts.append(x)
            qs.append(q)
            ps.append(p)
            prev = x
        ps.append(P_NEXT[prev])
        out += rule(drafts, torch.stack(qs), torch.stack(ps), g)
    return tuple(out[:3])


def chi_square_of(rule, n: int, seed: int, generate=None) -> float:
    """Pearson's statistic of n three-token sequences made by `generate(rule, g)` (default: the chain's
    generate_three) against the target Markov chain's probabilities."""
    generate = generate or generate_three
    g = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        key = generate(rule, g)
        counts[key] = counts.get(key, 0) + 1
    stat = 0.0
    for a in range(VOCAB):
        for b in range(VOCAB):
            for c in range(VOCAB):
                expected = n * float(P1[a] * P_NEXT[a, b] * P_NEXT[b, c])
                stat += (counts.get((a, b, c), 0) - expected) ** 2 / expected
    return stat


# Pearson chi-square over the 64 three-token sequences (63 degrees of freedom); the 1 - 1e-3 quantile is
# 103.4 (Wilson-Hilferty). With a correct sampler a fresh seed fails with probability 1e-3; the seed is fixed,
# so the test is deterministic. Smallest expected cell count: 6000 * 0.1 * 0.1 * 0.1 = 6 (>= 5, chi-square valid).
CHI2_63_999 = 103.4


def test_speculative_sampling_reproduces_the_target_distribution():
    assert chi_square_of(accept, 6000, seed=123) < CHI2_63_999


def test_statistical_test_catches_a_biased_rule():
    """The same test has power: accepting every draft (the draft's distribution, not the target's) fails."""
    def accept_all(drafts, qs, ps, g):
        return list(drafts)

    assert chi_square_of(accept_all, 6000, seed=123) > CHI2_63_999


# ------------------------------------------------------------------------------ token trees: multi-draft sampling

def tree_step(prev: int | None) -> tuple[list[int], list[int], torch.Tensor]:
    """A fixed token tree after `prev` (deterministic candidates, as Medusa's top-k and EAGLE's are) and the Markov
    target's distribution at each node: root children a, b and a repeated a; a has children c, d; c has e.

        root ─ a ─ c ─ e
             │   └ d
             ├ b
             └ a (again: a repeated sibling is never accepted twice)
    """
    base = 0 if prev is None else prev
    a, b = (base + 1) % VOCAB, (base + 2) % VOCAB
    c, d = (a + 3) % VOCAB, a
    e = (c + 1) % VOCAB
    tokens = [a, b, a, c, d, e]
    parents = [-1, -1, -1, 0, 0, 3]
    rows = [P1 if prev is None else P_NEXT[prev]] + [P_NEXT[x] for x in tokens]
    return tokens, parents, torch.stack(rows)


def generate_three_tree(rule, g: torch.Generator) -> tuple[int, ...]:
    out: list[int] = []
    while len(out) < 3:
        tokens, parents, probs = tree_step(out[-1] if out else None)
        out += rule(tokens, parents, probs, g)[1]
    return tuple(out[:3])


def tree_chi_square(rule, n: int, seed: int) -> float:
    return chi_square_of(rule, n, seed, generate_three_tree)


def test_tree_sampling_reproduces_the_target_distribution():
    """Same test, same 1e-3 false-failure rate as the chain's above: the three tokens produced by repeated tree
    steps (accepted paths of any depth, residual draws at any node) follow the target's Markov chain."""
    assert tree_chi_square(accept_tree_sampling, 6000, seed=321) < CHI2_63_999


def test_tree_statistical_test_catches_a_biased_rule():
    """Power: stepping into the first candidate at every node (no rejection) fails the same test."""
    def first_child_always(tokens, parents, probs, g):
        path, node = [], -1
        while (kids := [i for i, p in enumerate(parents) if p == node]):
            node = kids[0]
            path.append(node)
        return path, [tokens[i] for i in path] + [int(torch.multinomial(probs[node + 1], 1, generator=g))]

    assert tree_chi_square(first_child_always, 6000, seed=321) > CHI2_63_999


def test_tree_sampling_hand_cases():
    g = torch.Generator().manual_seed(0)
    # all of the root's mass on the second candidate: the first is rejected, the second accepted; its only child
    # has no mass either, so the token after it comes from that node's residual, never the rejected child
    probs = t([0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.5, 0.0, 0.5], [0.1, 0.2, 0.3, 0.4])
    for _ in range(50):
        path, emitted = accept_tree_sampling([1, 2, 2], [-1, -1, 1], probs, g)
        assert path == [1] and emitted[0] == 2 and emitted[1] in (1, 3)
    # no candidate has mass: nothing accepted, the residual draw never returns a candidate
    probs = t([0.5, 0.0, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0])
    for _ in range(50):
        path, emitted = accept_tree_sampling([1, 2], [-1, -1], probs, g)
        assert path == [] and len(emitted) == 1 and emitted[0] in (0, 3)


def test_verify_tree_samples_with_the_request_generator_and_greedy_walks_the_argmax():
    """verify_tree takes both kinds of request in one batch: the greedy one emits the argmax path, the sampled one
    is reproducible from its seed and only ever emits tokens of the processed (top-k) support."""
    vocab = 8
    torch.manual_seed(1)
    tokens, parents = [3, 5, 6], [-1, -1, 0]
    logits = torch.randn(2 * (len(tokens) + 1), vocab)
    logits[0, 3] = logits[1, 6] = 9.0  # greedy: root -> 3 (draft 0) -> 6 (draft 2), then row 3's argmax
    greedy = make_request(SamplingParams(temperature=0, max_tokens=20), [1, 2], [])
    runs = []
    for _ in range(2):
        sampled = make_request(SamplingParams(temperature=0.9, top_k=3, max_tokens=20), [1, 2], [], seed=11)
        runs.append(verify_tree(logits, [greedy, sampled], [tokens, tokens], [parents, parents]))
    (paths, emitted, rows), again = runs[0], runs[1]
    assert paths[0] == [0, 2] and emitted[0] == [3, 6, int(logits[3].argmax())] and rows[0] == [0, 1, 3]
    assert (paths[1], emitted[1]) == (again[0][1], again[1][1])  # same seed, same draws
    for node, tok in zip([-1] + paths[1], emitted[1], strict=True):  # each token within its row's top 3
        row = 4 + 1 + node
        assert tok in logits[row].topk(3).indices.tolist()
