"""SamplingParams validation and the batched sampler, each step against a hand-computed or exact oracle."""

from __future__ import annotations

import math

import pytest
import torch

from brisk.engine.request import Request
from brisk.engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_min_tokens_mask,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    greedy_sample,
    plain_greedy,
    random_sample,
    token_counts,
)
from brisk.engine.sampling_params import SamplingParams, SamplingType

NEG_INF = float("-inf")


def meta_for(params: list[SamplingParams], vocab_size: int, *, outputs=None, prompts=None, generators=None,
             eos=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(
        params, outputs or [[] for _ in range(n)], prompts or [[] for _ in range(n)], generators,
        vocab_size=vocab_size, eos_token_ids=eos)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X >= observed statistic) for Pearson's chi-square with (#categories - 1) degrees of freedom,
    over the categories with nonzero expected probability (the others must have zero counts)."""
    support = probs > 0
    assert int(counts[~support].sum()) == 0, f"sampled tokens outside the support: {counts[~support]}"
    expected = probs[support].double() * counts.sum()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    # The chi-square survival function is the regularized upper incomplete gamma Q(dof/2, stat/2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def sample_counts(logits_row: torch.Tensor, params: SamplingParams, num_samples: int,
                  seed: int) -> torch.Tensor:
    """Histogram of num_samples independent draws: one batch of identical rows, one sampler call."""
    vocab_size = logits_row.shape[0]
    logits = logits_row.expand(num_samples, vocab_size)  # [N, V]; a view, the sampler must not write into it
    meta = meta_for([params] * num_samples, vocab_size)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        tokens = Sampler()(logits, meta).sampled_token_ids
    return torch.bincount(torch.tensor(tokens), minlength=vocab_size)


# ---------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("kwargs, name", [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": "7"}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_invalid_params_raise_value_error_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        SamplingParams(**kwargs)


def test_messages_state_the_allowed_range():
    with pytest.raises(ValueError, match=r"temperature must be non-negative, got -1.0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"n must be at least 1, got 0"):
        SamplingParams(n=0)


def test_boundary_values_are_accepted_and_fields_normalized():
    p = SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, top_p=1.0, top_k=-1, min_p=1.0,
                       max_tokens=3, min_tokens=3, logprobs=20, stop="###", seed=0)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.top_k == 0
    assert SamplingParams().stop == [] and SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    # Greedy ignores truncation, so its truncation settings are reset to neutral (as vLLM does).
    g = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3)
    assert (g.top_k, g.top_p, g.min_p) == (0, 1.0, 0.0)


def test_sampling_type_and_stop_ids():
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams.greedy(max_tokens=4).is_greedy
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    p = SamplingParams(stop_token_ids=[5, 7])
    assert p.all_stop_token_ids == {5, 7}
    assert p.stop_token_ids_with([2]) == {2, 5, 7}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).stop_token_ids_with([2]) == {5}


def test_clone_is_independent():
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    c = p.clone()
    c.stop.append("b")
    c.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1]
    assert c == SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])


# ---------------------------------------------------------------- pure functions

def test_top_p_keeps_smallest_set_reaching_p():
    # probs by id: 0 -> 0.05, 1 -> 0.5, 2 -> 0.15, 3 -> 0.3 (descending: 1, 3, 2, 0)
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log().expand(4, 4)
    p = torch.tensor([0.4, 0.75, 0.85, 1.0])
    out = apply_top_k_top_p(logits, None, p)
    kept = torch.isfinite(out)
    assert kept.tolist() == [
        [False, True, False, False],  # 0.5 >= 0.4
        [False, True, False, True],  # 0.5 + 0.3 = 0.8 >= 0.75
        [False, True, True, True],  # 0.95 >= 0.85
        [True, True, True, True],
    ]
    assert torch.equal(out[kept], logits[kept])  # survivors are untouched


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """top_p = 5e-324 passes the p > 0 check as a Python float and is 0.0 in the float32 batch tensor: the most likely
    token stays (it used to index rank -1 and fail the whole step)."""
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    out = apply_top_k_top_p(logits, None, torch.tensor([5e-324], dtype=torch.float32))
    assert torch.isfinite(out).tolist() == [[False, True, False, False]]


def top_p_oracle(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Kept-token mask of one row by the definition: sort, keep ranks whose preceding mass is below p."""
    probs = torch.softmax(logits.double(), -1)
    sorted_probs, order = probs.sort(descending=True)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < p
    return torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)


def test_top_p_matches_sort_oracle_when_the_nucleus_is_large_and_rows_are_batch_independent():
    # Rows range from peaked (nucleus of a few tokens) to nearly flat (nucleus of thousands), so the
    # candidate set must grow past its first size; p values avoid float ties with the oracle's cumsum.
    vocab_size = 5000
    rng = torch.Generator().manual_seed(6)
    scales = torch.tensor([8.0, 3.0, 1.0, 0.3, 0.05, 2.0])
    logits = torch.randn(6, vocab_size, generator=rng) * scales.unsqueeze(1)
    p = torch.tensor([0.9, 0.5, 0.95, 0.7, 0.99, 1.0])
    out = apply_top_k_top_p(logits, None, p)
    num_kept = []
    for i in range(6):
        expected = top_p_oracle(logits[i], float(p[i])) if p[i] < 1 else torch.ones(vocab_size, dtype=torch.bool)
        assert torch.equal(torch.isfinite(out[i]), expected), f"row {i}"
        num_kept.append(int(expected.sum()))
        alone = apply_top_k_top_p(logits[i:i + 1], None, p[i:i + 1])
        assert torch.equal(alone, out[i:i + 1]), f"row {i} depends on its batch-mates"
    assert num_kept[0] < 64 < num_kept[4] < vocab_size  # both the first candidate set and growth are used


def test_top_k_per_row_and_combined_with_top_p():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 2.0],
                           [0.0, 1.0, 2.0, 3.0, 4.0],
                           [0.0, 1.0, 2.0, 3.0, 4.0]])
    k = torch.tensor([1, 3, 5])
    # Top-k alone (the topk path): ties with the k-th value are kept.
    assert torch.isfinite(apply_top_k_top_p(logits, torch.tensor([2, 3, 5]), None)).tolist() == [
        [True, False, True, False, True],
        [False, False, True, True, True],
        [True] * 5,
    ]
    # With top-p (the sort path): top-p then acts on the top-k set renormalized.
    p = torch.tensor([1.0, 0.5, 0.6])
    out = apply_top_k_top_p(logits, k, p)
    # row 1: top-3 probs over {4, 3, 2} are 0.665, 0.245, 0.090 -> p = 0.5 keeps only id 4.
    # row 2: full softmax 0.636, 0.234, 0.086, ... -> p = 0.6 keeps only id 4.
    assert torch.isfinite(out).tolist() == [
        [True, False, False, False, False],
        [False, False, False, False, True],
        [False, False, False, False, True],
    ]
    out = apply_top_k_top_p(logits, k, torch.tensor([1.0, 0.7, 0.7]))
    assert torch.isfinite(out)[1:].tolist() == [[False, False, False, True, True]] * 2


def test_min_p_threshold_is_relative_to_top_probability():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(3, 4)
    out = apply_min_p(logits, torch.tensor([0.0, 0.2, 0.5]))
    assert torch.isfinite(out).tolist() == [
        [True, True, True, True],
        [True, True, True, False],  # threshold 0.1
        [True, True, False, False],  # threshold 0.25
    ]


def test_penalties_exact():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]] * 4)
    prompts = [[0, 0]] * 4
    outputs = [[1, 1, 2]] * 4  # counts: id1 -> 2, id2 -> 1
    zeros = torch.zeros(4)
    rep = apply_penalties(logits, prompts, outputs, None, None, torch.tensor([2.0, 1.0, 0.5, 2.0]))
    assert rep.tolist() == [
        [1.0, -2.0, 0.25, -3.0, 1.0],  # prompt and output ids: positive / 2, negative * 2; id 3, 4 unseen
        [2.0, -1.0, 0.5, -3.0, 1.0],
        [4.0, -0.5, 1.0, -3.0, 1.0],
        [1.0, -2.0, 0.25, -3.0, 1.0],
    ]
    # Presence / frequency see only output tokens: id 0 (prompt only) keeps its logit.
    pf = apply_penalties(logits, prompts, outputs, torch.tensor([0.1, 0.0, 0.1, -1.0]),
                         torch.tensor([0.0, 0.5, 0.5, 0.0]), None)
    expected = torch.tensor([
        [2.0, -1.1, 0.4, -3.0, 1.0],
        [2.0, -2.0, 0.0, -3.0, 1.0],
        [2.0, -2.1, -0.1, -3.0, 1.0],
        [2.0, 0.0, 1.5, -3.0, 1.0],
    ])
    torch.testing.assert_close(pf, expected)
    # All three: repetition first, then frequency and presence on the result.
    both = apply_penalties(logits[:1], prompts[:1], outputs[:1], torch.tensor([0.1]), torch.tensor([0.5]),
                           torch.tensor([2.0]))
    torch.testing.assert_close(both, torch.tensor([[1.0, -3.1, -0.35, -3.0, 1.0]]))
    assert torch.equal(apply_penalties(logits, prompts, outputs, zeros, zeros, torch.ones(4)), logits)


def test_token_counts_and_masks():
    assert token_counts([[3, 1, 3], [], [0]], 4, "cpu").tolist() == [[0, 1, 0, 2], [0, 0, 0, 0], [1, 0, 0, 0]]
    logits = torch.zeros(2, 4)
    out = apply_min_tokens_mask(logits, {1: [0, 3]})
    assert out.tolist() == [[0, 0, 0, 0], [NEG_INF, 0, 0, NEG_INF]] and logits.eq(0).all()
    t = apply_temperature(torch.tensor([[1.0, -2.0], [1.0, -2.0]]), torch.tensor([0.0, 0.5]))
    assert t.tolist() == [[1.0, -2.0], [2.0, -4.0]]


def test_random_sample_uses_row_generators_not_global_rng():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    tokens = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        gens = {0: torch.Generator().manual_seed(7), 2: torch.Generator().manual_seed(8)}
        tokens.append(random_sample(probs.clone(), gens).tolist())
    assert tokens[0][0] == tokens[1][0] and tokens[0][2] == tokens[1][2]
    # A zero-probability token is never drawn.
    masked = torch.tensor([[0.0, 1.0, 0.0]]).expand(1000, 3).contiguous()
    assert random_sample(masked, {}).eq(1).all()


# ---------------------------------------------------------------- the Sampler

def test_greedy_is_argmax_and_input_logits_are_untouched():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1), dtype=torch.float16)
    before = logits.clone()
    out = Sampler()(logits, meta_for([SamplingParams.greedy()] * 6, 100))
    assert out.sampled_token_ids == greedy_sample(logits.float()).tolist() and out.logprobs is None
    # float32 input aliases after .float(): penalties and masks must not write into the caller's tensor.
    logits32 = before.float()
    copy32 = logits32.clone()
    meta = meta_for([SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                                    presence_penalty=0.5, min_tokens=3)] * 6, 100,
                    outputs=[[1, 2]] * 6, prompts=[[3]] * 6, eos=[[0]] * 6)
    Sampler()(logits32, meta)
    assert torch.equal(logits32, copy32) and torch.equal(logits, before)


@pytest.mark.parametrize("vocab", [1, 7, 31, 32, 33, 100, 1000, 49152])
def test_greedy_kernel_equals_torch_argmax_with_ties_infinities_and_nans(kernel_settings, vocab):
    """greedy_sample's C++ argmax (ops/csrc/fused_ops.cpp argmax_rows) against torch.argmax, and the pure-PyTorch
    path (kernels switched off) against both: lowest index among ties, -inf rows, +inf, first NaN."""
    g = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=g), torch.full((vocab,), -math.inf), torch.zeros(vocab),
            torch.randint(0, 3, (vocab,), generator=g).float()]  # many ties
    tail = torch.randn(vocab, generator=g)
    tail[-1] = 100.0  # the maximum in the scalar tail
    inf = torch.randn(vocab, generator=g)
    inf[vocab // 2] = math.inf
    nan = torch.randn(vocab, generator=g)
    nan[vocab // 3] = math.nan
    nan[-1] = math.nan
    logits = torch.stack(rows + [tail, inf, nan])
    expected = logits.argmax(-1)
    assert torch.equal(greedy_sample(logits), expected)
    assert torch.equal(greedy_sample(logits[:, : max(1, vocab // 2)]), logits[:, : max(1, vocab // 2)].argmax(-1))
    kernel_settings(enabled=False)
    assert torch.equal(greedy_sample(logits), expected)


def test_plain_greedy_is_exactly_when_the_sampler_would_return_the_bare_argmax():
    """The runner skips the metadata for rows plain_greedy accepts; for every other setting the Sampler's answer
    may differ from the argmax of the raw logits, so each must be refused."""
    assert plain_greedy(SamplingParams.greedy(), 0)
    assert plain_greedy(SamplingParams(temperature=0.0, seed=3, min_tokens=2), 2)
    for params, n in [(SamplingParams(temperature=0.5), 0), (SamplingParams(temperature=0.0, logprobs=2), 0),
                      (SamplingParams(temperature=0.0, presence_penalty=0.5), 0),
                      (SamplingParams(temperature=0.0, frequency_penalty=0.5), 0),
                      (SamplingParams(temperature=0.0, repetition_penalty=1.2), 0),
                      (SamplingParams(temperature=0.0, min_tokens=2), 1)]:
        assert not plain_greedy(params, n), params
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5))
    out = Sampler()(logits, meta_for([SamplingParams.greedy()] * 4, 300))
    assert out.sampled_token_ids == greedy_sample(logits).tolist()


def test_top_k_1_equals_greedy_and_mixed_batch_greedy_rows_take_penalized_argmax():
    logits = torch.randn(32, 200, generator=torch.Generator().manual_seed(2))
    out = Sampler()(logits, meta_for([SamplingParams(temperature=1.5, top_k=1)] * 32, 200))
    assert out.sampled_token_ids == logits.argmax(-1).tolist()

    row = torch.tensor([1.0, 5.0, 4.9, 0.0])
    params = [SamplingParams.greedy(frequency_penalty=0.2), SamplingParams(temperature=1.0),
              SamplingParams.greedy()]
    out = Sampler()(row.expand(3, 4), meta_for(params, 4, outputs=[[1], [], [1]]))
    assert out.sampled_token_ids[0] == 2  # 5.0 - 0.2 < 4.9
    assert out.sampled_token_ids[2] == 1  # no penalty on this row


def test_seeded_request_is_independent_of_batch_composition():
    vocab_size, num_steps, seed = 64, 8, 1234
    rng = torch.Generator().manual_seed(5)
    own_rows = [torch.randn(vocab_size, generator=rng) * 1.5 for _ in range(num_steps)]
    own = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)

    def run(position: int, others: list[SamplingParams], global_seed: int, own_seed: int = seed) -> list[int]:
        torch.manual_seed(global_seed)
        own_gen = torch.Generator().manual_seed(own_seed)
        other_gens = {i: torch.Generator().manual_seed(100 + i)
                      for i, p in enumerate(others) if p.seed is not None}
        tokens: list[int] = []
        for step in range(num_steps):
            batch = [torch.randn(vocab_size, generator=rng) for _ in others]
            batch.insert(position, own_rows[step])
            params = list(others)
            params.insert(position, own)
            gens = {(i if i < position else i + 1): g for i, g in other_gens.items()}
            gens[position] = own_gen
            outputs = [[1, 2, step] for _ in params]
            meta = meta_for(params, vocab_size, outputs=outputs, generators=gens)
            out = Sampler()(torch.stack(batch), meta)
            tokens.append(out.sampled_token_ids[position])
        return tokens

    alone = run(0, [], global_seed=0)
    others = [SamplingParams.greedy(), SamplingParams(top_k=5, presence_penalty=1.0),
              SamplingParams(temperature=0.5, min_p=0.1, seed=9),
              SamplingParams(repetition_penalty=1.5, logprobs=3)]
    assert run(2, others, global_seed=1) == alone
    assert run(4, others[::-1], global_seed=2) == alone
    assert run(1, others[:2], global_seed=3) == alone
    assert len(set(alone)) > 1  # the draws are really random ...
    assert run(0, [], global_seed=0, own_seed=seed + 1) != alone  # ... and really driven by the seed


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampled_distribution_matches_softmax(temperature):
    # 40,000 draws over 8 tokens. The test fails when the chi-square p-value is below 1e-4, so a correct
    # sampler would fail with probability 1e-4 per fresh seed; the seed is fixed, so the outcome is too.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -2.0])
    counts = sample_counts(logits, SamplingParams(temperature=temperature), 40_000, seed=11)
    assert chi_square_p_value(counts, torch.softmax(logits / temperature, -1)) > 1e-4
    # Power check: the same counts reject the untempered distribution when temperature matters.
    if temperature != 1.0:
        assert chi_square_p_value(counts, torch.softmax(logits, -1)) < 1e-10


def test_sampled_distribution_with_top_k_and_top_p_is_the_renormalized_kept_set():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -2.0])
    # top_k = 4 keeps ids {0, 6, 1, 2} with renormalized probs 0.455, 0.276, 0.167, 0.102;
    # top_p = 0.8 then keeps {0, 6, 1} (0.898 >= 0.8; the first two only reach 0.731).
    counts = sample_counts(logits, SamplingParams(top_k=4, top_p=0.8), 20_000, seed=12)
    expected = torch.zeros(8)
    expected[[0, 6, 1]] = torch.softmax(logits[[0, 6, 1]], -1)
    assert chi_square_p_value(counts, expected) > 1e-4  # false-failure rate 1e-4, as above


def test_logprobs_are_raw_log_softmax_and_include_sampled_token():
    vocab_size = 30
    logits = torch.randn(4, vocab_size, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.4, logprobs=3),
              SamplingParams(temperature=0.9),
              SamplingParams.greedy(logprobs=0, frequency_penalty=2.0),
              SamplingParams(temperature=1.2, logprobs=20)]
    meta = meta_for(params, vocab_size, outputs=[[int(logits[i].argmax())] * 3 for i in range(4)],
                    generators={0: torch.Generator().manual_seed(0)})
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for i, n in ((0, 3), (2, 0), (3, 20)):
        row = out.logprobs[i]
        sampled = out.sampled_token_ids[i]
        top = raw[i].topk(n).indices.tolist()
        assert list(row)[0] == sampled and set(row) == {sampled, *top}
        for t, lp in row.items():
            assert math.isclose(lp, float(raw[i, t]), rel_tol=0, abs_tol=1e-6)
    # The frequency penalty moved row 2 off its raw argmax; its logprob is still the raw one.
    assert out.sampled_token_ids[2] != int(logits[2].argmax())
    assert Sampler()(logits, meta_for([SamplingParams()] * 4, vocab_size)).logprobs is None


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    vocab_size, eos = 6, 5
    logits = torch.tensor([0.0, 1.0, 0.0, 0.0, 8.0, 9.0]).expand(4, vocab_size)
    params = [SamplingParams.greedy(min_tokens=3),  # 2 outputs so far: EOS (5) banned, 4 wins
              SamplingParams.greedy(min_tokens=2),  # 2 outputs: reached, EOS allowed
              SamplingParams.greedy(min_tokens=3, stop_token_ids=[4]),  # 4 and 5 banned
              SamplingParams.greedy(min_tokens=3, ignore_eos=True)]  # EOS does not stop it: not banned
    meta = meta_for(params, vocab_size, outputs=[[1, 1]] * 4, eos=[[eos]] * 4)
    assert meta.min_tokens_banned == {0: [5], 2: [4, 5]}
    assert Sampler()(logits, meta).sampled_token_ids == [4, 5, 1, 5]
    # The same ban holds for random rows.
    meta = meta_for([SamplingParams(temperature=1.0, min_tokens=1)] * 200, vocab_size, eos=[[eos]] * 200)
    assert eos not in Sampler()(logits[0].expand(200, vocab_size), meta).sampled_token_ids


def test_metadata_from_requests_skips_unused_settings():
    gen = torch.Generator().manual_seed(4)
    reqs = [Request("a", [1, 2], SamplingParams.greedy(), eos_token_ids=[0]),
            Request("b", [3], SamplingParams(temperature=0.5, seed=4, min_tokens=1), eos_token_ids=[0],
                    generator=gen)]
    meta = SamplingMetadata.from_requests(reqs, vocab_size=10)
    assert meta.temperature.tolist() == [0.0, 0.5] and not meta.all_greedy and not meta.all_random
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None and meta.no_penalties
    assert meta.generators == {1: gen} and meta.min_tokens_banned == {1: [0]}
    assert meta.max_num_logprobs is None
    assert meta.prompt_token_ids == [[1, 2], [3]]
    meta = meta_for([SamplingParams(top_k=50, logprobs=2), SamplingParams(logprobs=0)], 10)
    assert meta.top_k.tolist() == [10, 10] and meta.max_num_logprobs == 2 and meta.all_random
