"""Batched sampling: one logits row per sequence sampled this step -> one token id per row (+ logprobs).

The order is vLLM's:

    raw logits --(log_softmax)--> logprobs returned to the user (the model's own, untouched by settings)
       |
    min_tokens mask (ban EOS/stop ids) -> penalties -> greedy rows: argmax here
       |
    temperature -> min_p -> top_k / top_p -> softmax -> exponential race -> random rows' tokens

Every step is a pure function over [B, V] float32 tensors with per-row parameters, so a batch mixes
greedy, seeded and unseeded requests with different settings in one pass. Work that no row needs is
skipped (the metadata holds None for an unused parameter), so an all-greedy batch is one argmax.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from brisk.engine.sampling_params import SAMPLING_EPS, SamplingParams
from brisk.ops.kernels import get_op

if TYPE_CHECKING:
    from brisk.engine.request import Request

# Smallest positive float32: the floor for the exponential draws of random_sample.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step, built by the model runner; row i describes logits row i.

    An optional tensor is None when no row uses that setting (the sampler then skips it); where it is
    present, rows that do not use it hold the neutral value (top_k = vocab size, top_p = 1, min_p = 0,
    penalties 0 / 0 / 1).
    """

    temperature: torch.Tensor  # [B] float32, 0.0 on greedy rows
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # [B] int64 in [1, V]
    top_p: torch.Tensor | None = None  # [B] float32 in (0, 1]
    min_p: torch.Tensor | None = None  # [B] float32 in [0, 1]
    presence_penalty: torch.Tensor | None = None  # [B] float32
    frequency_penalty: torch.Tensor | None = None  # [B] float32
    repetition_penalty: torch.Tensor | None = None  # [B] float32
    output_token_ids: list[list[int]] = field(default_factory=list)  # per row, for the penalties
    prompt_token_ids: list[list[int]] = field(default_factory=list)  # per row, for the repetition penalty
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded request's RNG
    num_logprobs: list[int | None] = field(default_factory=list)  # per row; None = this row wants none
    max_num_logprobs: int | None = None  # None = no row wants logprobs
    min_tokens_banned: dict[int, list[int]] = field(default_factory=dict)  # row -> ids banned this step

    @property
    def no_penalties(self) -> bool:
        return (self.presence_penalty is None and self.frequency_penalty is None
                and self.repetition_penalty is None)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[list[int]],
        prompt_token_ids: Sequence[list[int]],
        generators: dict[int, torch.Generator] | None = None,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[Sequence[int]] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Gather the rows' settings into tensors. `eos_token_ids[i]` is row i's EOS set (banned, with its
        stop ids, while the row has fewer than min_tokens outputs); `generators` maps row -> its RNG."""
        num_rows = len(params)
        assert len(output_token_ids) == num_rows and len(prompt_token_ids) == num_rows, (
            f"{num_rows} params but {len(output_token_ids)} output and {len(prompt_token_ids)} prompt lists")
        if eos_token_ids is None:
            eos_token_ids = [()] * num_rows
        greedy = [p.temperature < SAMPLING_EPS for p in params]

        def row_tensor(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        def if_used(used: bool, values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
            return row_tensor(values, dtype) if used else None

        # Greedy params already have top_k/top_p/min_p reset to neutral (SamplingParams.__post_init__).
        top_k = if_used(any(p.top_k > 0 for p in params),
                        [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                        torch.int64)
        num_logprobs = [p.logprobs for p in params]
        wanted = [n for n in num_logprobs if n is not None]

        min_tokens_banned: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                banned = p.stop_token_ids_with(eos_token_ids[i])
                if banned:
                    min_tokens_banned[i] = sorted(banned)

        return cls(
            temperature=row_tensor([0.0 if g else p.temperature
                                    for g, p in zip(greedy, params, strict=True)]),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=top_k,
            top_p=if_used(any(p.top_p < 1.0 for p in params), [p.top_p for p in params]),
            min_p=if_used(any(p.min_p > 0.0 for p in params), [p.min_p for p in params]),
            presence_penalty=if_used(any(p.presence_penalty != 0.0 for p in params),
                                     [p.presence_penalty for p in params]),
            frequency_penalty=if_used(any(p.frequency_penalty != 0.0 for p in params),
                                      [p.frequency_penalty for p in params]),
            repetition_penalty=if_used(any(p.repetition_penalty != 1.0 for p in params),
                                       [p.repetition_penalty for p in params]),
            output_token_ids=list(output_token_ids),
            prompt_token_ids=list(prompt_token_ids),
            # A greedy row never draws, so its generator (if any) is left untouched.
            generators={i: g for i, g in (generators or {}).items() if not greedy[i]},
            num_logprobs=num_logprobs,
            max_num_logprobs=max(wanted) if wanted else None,
            min_tokens_banned=min_tokens_banned,
        )

    @classmethod
    def from_requests(
        cls, requests: Sequence[Request], *, vocab_size: int, device: torch.device | str = "cpu"
    ) -> SamplingMetadata:
        """One row per request, sampling the request's next token."""
        return cls.from_params(
            [r.sampling_params for r in requests],
            [r.output_token_ids for r in requests],
            [r.prompt_token_ids for r in requests],
            {i: r.generator for i, r in enumerate(requests) if r.generator is not None},
            vocab_size=vocab_size,
            eos_token_ids=[r.eos_token_ids for r in requests],
            device=device,
        )


def plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a row's next token is the bare argmax of its logits: greedy, no penalties, no logprobs, min_tokens
    reached (nothing from_params / Sampler would apply). The runner then skips the metadata (~50 us a step at
    batch 1 once the forward has pushed the interpreter's data out of the caches)."""
    return (params.temperature < SAMPLING_EPS and params.logprobs is None and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
            and num_output_tokens >= params.min_tokens)


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # [B]
    # Per row: {sampled token: logprob, top-k tokens: logprob} from the raw log-softmax, or None for a row
    # that did not ask; the whole list is None when no row asked.
    logprobs: list[dict[int, float] | None] | None = None


class Sampler:
    """Turns a [B, V] logits matrix into one token per row, following each row's SamplingParams."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == meta.temperature.shape[0], (
            f"logits {tuple(logits.shape)} must be [B, V] with B = {meta.temperature.shape[0]} metadata rows")
        assert meta.temperature.device == logits.device, (
            f"sampling metadata is on {meta.temperature.device} but logits are on {logits.device}: "
            "build it with from_params(..., device=logits.device)")
        logits = logits.float()  # [B, V]; may alias the caller's tensor, so every step below is out-of-place
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None

        if meta.min_tokens_banned:
            logits = apply_min_tokens_mask(logits, meta.min_tokens_banned)
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta.prompt_token_ids, meta.output_token_ids,
                                     meta.presence_penalty, meta.frequency_penalty, meta.repetition_penalty)
        sampled = self.sample(logits, meta)  # [B] int64

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.num_logprobs, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=logprobs)

    @staticmethod
    def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Token ids [B] from penalized logits [B, V]."""
        greedy = None
        if not meta.all_random:
            greedy = greedy_sample(logits)
            if meta.all_greedy:
                return greedy
        logits = apply_temperature(logits, meta.temperature)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        sampled = random_sample(torch.softmax(logits, dim=-1), meta.generators)
        if greedy is None:
            return sampled
        return torch.where(meta.temperature < SAMPLING_EPS, greedy, sampled)


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """counts[i, t] = how many times token t occurs in token_ids[i]; [B, V] float32."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    lengths = [len(t) for t in token_ids]
    if sum(lengths) == 0:
        return counts
    # One flat scatter instead of padding: rows[j] is the row that the j-th flattened token belongs to.
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device),
                                   torch.tensor(lengths, device=device))
    counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    repetition_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Penalize tokens already seen; each penalty tensor is [B] or None (unused).

    repetition (CTRL paper, as HF/vLLM): over prompt + output tokens, a positive logit is divided by the
        penalty and a negative one multiplied, so penalty > 1 always lowers the token's probability.
    presence / frequency (OpenAI): over output tokens only,
        logit -= presence * (count > 0) + frequency * count.
    """
    num_rows, vocab_size = logits.shape
    output_counts = token_counts(output_token_ids, vocab_size, logits.device)  # [B, V]
    if repetition_penalty is not None:
        seen = (output_counts > 0) | (token_counts(prompt_token_ids, vocab_size, logits.device) > 0)  # [B, V]
        penalty = torch.where(seen, repetition_penalty.unsqueeze(1), 1.0)  # [B, V]; 1 = untouched
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if frequency_penalty is not None:
        logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    if presence_penalty is not None:
        logits = logits - presence_penalty.unsqueeze(1) * (output_counts > 0)
    return logits


def apply_min_tokens_mask(logits: torch.Tensor, banned: dict[int, list[int]]) -> torch.Tensor:
    """Set logits[row, t] = -inf for each t in banned[row]: a row under min_tokens may not stop yet."""
    rows = [row for row, ids in banned.items() for _ in ids]
    cols = [t for ids in banned.values() for t in ids]
    out = logits.clone()
    out[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return out


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / t per row; greedy rows (t == 0) are divided by 1, their token comes from the argmax anyway."""
    temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
    return logits / temperature.unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability (min_p = 0 keeps all)."""
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's k largest logits, then the smallest set of those whose probability reaches p.

    top_k: [B] int64 in [1, V] (V = disabled); top_p: [B] float in (0, 1] (1 = disabled); either None.
    Both cuts are thresholds on value, so tokens tied with the last kept one are kept too (and the result
    does not depend on how a sort orders ties). The top token always survives both filters.
    """
    if top_k is not None:
        logits = apply_top_k(logits, top_k)
    if top_p is not None:
        logits = apply_top_p(logits, top_p)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask all but each row's k largest logits (k = V leaves the row alone)."""
    enabled = top_k < logits.shape[1]  # [B]
    if not bool(enabled.any()):
        return logits
    # Only the k-th largest value per row is needed: a partial top-k up to the largest k in use, not a sort
    # (torch's CPU sort of a 49k vocabulary costs tens of ms; topk(50) costs ~0.1 ms).
    max_k = int(torch.where(enabled, top_k, 0).max())
    top_values = torch.topk(logits, max_k, dim=-1).values  # [B, max_k], descending
    kth = top_values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))  # [B, 1]
    kth = kth.masked_fill(~enabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


# First candidate-set size for top-p, and its growth factor when some row's nucleus is larger.
_TOP_P_FIRST_CANDIDATES = 64
_TOP_P_GROWTH = 8


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask all but the smallest set of most likely tokens whose total probability reaches p (p = 1: no-op).

    Rank r is kept iff the mass of the ranks before it is still below p:
        probs (descending) | 0.5 | 0.3 | 0.15 | 0.05 |
        mass before        | 0.0 | 0.5 | 0.8  | 0.95 |    p = 0.75 keeps ranks 0, 1 (total 0.8 >= p).
    Rank 0 has mass 0 < p, so at least one token stays. The nucleus is usually tens of tokens, so instead
    of sorting the vocabulary we take the top K candidates and grow K until every row's candidates reach
    its p (a prefix of the sorted order is all the rule reads). Rows with p = 1 are left alone: a float
    cumsum can reach 1.0 before the tail, and those rows must not depend on their batch-mates.
    """
    enabled = top_p < 1.0  # [B]
    if not bool(enabled.any()):
        return logits
    vocab_size = logits.shape[1]
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    num_candidates = min(_TOP_P_FIRST_CANDIDATES, vocab_size)
    while True:
        cand_probs = torch.topk(probs, num_candidates, dim=-1).values  # [B, K], descending
        cum_probs = torch.cumsum(cand_probs, dim=-1)  # [B, K]
        # Once the top K reach p, rank K has mass-before >= p: nothing past the candidates is kept.
        covered = (cum_probs[:, -1] >= top_p) | ~enabled
        if num_candidates == vocab_size or bool(covered.all()):
            break
        num_candidates = min(num_candidates * _TOP_P_GROWTH, vocab_size)
    # [B], >= 1: rank 0 always stays, also for a p that rounds to 0 in float32 (5e-324 passes a p > 0 check)
    num_kept = ((cum_probs - cand_probs) < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    min_kept_prob = cand_probs.gather(1, (num_kept - 1).unsqueeze(1))  # [B, 1]
    return logits.masked_fill((probs < min_kept_prob) & enabled.unsqueeze(1), float("-inf"))


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] argmax (the lowest id among ties; a row with a NaN gives its first NaN, as torch.argmax)."""
    if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0:
        op = get_op("argmax_rows")  # vectorized; ATen's CPU argmax is ~30 us on a 49k vocabulary
        if op is not None:
            return op(logits)
    return logits.argmax(dim=-1)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from probs [B, V] by an exponential race: argmax_t probs[t] / q[t], q ~ Exp(1).

    q[t] / probs[t] ~ Exp(rate = probs[t]); the smallest of independent exponentials is token t with
    probability probs[t] / sum(probs), so the argmax is an exact sample, with no cumsum or search. A row in
    `generators` draws its q from its own generator, so a seeded request's tokens depend only on its
    generator and its own logits, not on which rows share the batch; the others share one draw.
    q is drawn as -log(u), u ~ U[0, 1): on CPU that is ~10x faster than Tensor.exponential_.
    """
    u = torch.empty_like(probs)  # [B, V]
    if len(generators) < probs.shape[0]:
        u.uniform_()
    for row, generator in generators.items():
        if generator.device == probs.device:
            u[row].uniform_(generator=generator)
        else:  # e.g. a CPU generator for a CUDA batch: draw where the generator lives, then move
            u[row] = torch.rand(probs.shape[1], generator=generator, device=generator.device)
    # u < 1 makes q > 0; the floor guards the contract anyway, since q == 0 on a zero-probability token
    # would give 0 / 0 = NaN, which argmax picks.
    q = u.log_().neg_().clamp_min_(_TINY)
    return probs.div_(q).argmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: Sequence[int | None], max_num_logprobs: int
) -> list[dict[int, float] | None]:
    """Per row that asked for n logprobs: {sampled token: lp, then the n most likely tokens: lp}."""
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()  # [B]
    top_lp: list[list[float]] = [[] for _ in num_logprobs]
    top_ids: list[list[int]] = [[] for _ in num_logprobs]
    if max_num_logprobs > 0:
        k = min(max_num_logprobs, logprobs.shape[1])
        values, ids = torch.topk(logprobs, k, dim=-1)  # [B, k]
        top_lp, top_ids = values.tolist(), ids.tolist()
    sampled_ids = sampled.tolist()
    out: list[dict[int, float] | None] = []
    for i, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        row = {sampled_ids[i]: sampled_lp[i]}
        for t, lp in zip(top_ids[i][:n], top_lp[i][:n], strict=True):
            row.setdefault(t, lp)
        out.append(row)
    return out
