"""The fused RMSNorm / add + RMSNorm / SiLU-mul kernels against their PyTorch references and a float64 oracle,
the reference paths against the kernels, and a whole model with the kernels on and off."""

from __future__ import annotations

import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.model.loader import load_model
from brisk.ops import kernels
from brisk.ops.attention import AttentionMetadata
from brisk.ops.fused import (
    add_rms_norm,
    gelu_tanh_mul,
    gelu_tanh_mul_reference,
    rms_norm,
    rms_norm_reference,
    silu_mul,
    silu_mul_reference,
)

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 64]  # decode, a few decodes, a prefill chunk (64 x 576 is past the threading threshold)
WIDTHS = [576, 64, 100]  # SmolLM2's hidden size, one 8-wide block multiple, and 100 = 12 x 8 + a 4-wide tail
EPS = 1e-5


@pytest.fixture(scope="module")
def ops():
    """Build (or load the cached build of) the extension once, whatever the environment says."""
    with kernels.override(enabled=True):
        found = kernels.get_ops()
    if found is None or not hasattr(found, "rms_norm"):
        pytest.fail("the fused C++ kernels did not build; see the warning logged by brisk.ops.kernels")
    return found


def inputs(rows: int, width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """x [rows, width] with a spread of row scales (the norm must undo each), a residual and a weight near 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    residual = torch.randn(rows, width, generator=g)
    weight = 1 + 0.3 * torch.randn(width, generator=g)
    return x.to(dtype), residual.to(dtype), weight.to(dtype)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        # the same float32 formula summed in another order: a few ulps of the result
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        # Both round the same float32 value to bf16; the sums differ in the last float32 bits, which can move
        # a value across a rounding boundary: at most one bf16 ulp (relative 2^-8 .. 2^-7), and rarely.
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
        assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_equals_reference(ops, dtype, rows, width):
    x, _, w = inputs(rows, width, dtype, seed=rows * width)
    got = ops.rms_norm(x, w, EPS)
    assert_matches(got, rms_norm_reference(x, w, EPS))
    if dtype == torch.float32:  # and the textbook formula in float64: float32 rounding only
        x64 = x.double()
        want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm_equals_add_then_norm(ops, dtype, rows, width):
    x, residual, w = inputs(rows, width, dtype, seed=rows + width)
    want_residual = residual + x  # rounded to dtype, as a separate add would be
    want = rms_norm_reference(want_residual, w, EPS)
    got = ops.add_rms_norm(x, residual, w, EPS)
    assert torch.equal(residual, want_residual)  # the sum is written back into residual, bit for bit
    assert_matches(got, want)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_bfloat16_rows_with_a_float32_weight(ops, rows, width):
    """Gemma3RMSNorm on bfloat16 rows (round_once): x * r * (1 + w) all in float32, rounded to bfloat16 once (not
    the Llama norm's two roundings): the kernels, the references and HF's formula agree; the residual add rounds as
    before. (Without round_once the public functions keep the Llama norm's promotion to float32.)"""
    x, residual, w = inputs(rows, width, torch.bfloat16, seed=rows * 3 + width)
    w = w.float() - 1.0 + 1.0 + 0.01 * torch.arange(width) / width  # a float32 multiplier bf16 cannot hold
    x32 = x.float()
    hf = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * w).to(torch.bfloat16)
    got = ops.rms_norm(x, w, EPS)
    assert_matches(got, rms_norm_reference(x, w, EPS, round_once=True))
    assert_matches(got, hf)
    assert torch.equal(rms_norm(x, w, EPS, round_once=True), got)  # the public function takes the kernel
    want_residual = residual + x
    got = ops.add_rms_norm(x, residual, w, EPS)
    assert torch.equal(residual, want_residual)
    assert_matches(got, rms_norm_reference(want_residual, w, EPS, round_once=True))
    r = want_residual.clone()
    assert torch.equal(add_rms_norm(x, residual, w, EPS, round_once=True)[0], ops.add_rms_norm(x, r, w, EPS))
    with pytest.raises(RuntimeError, match="weight dtype BFloat16 must be x's"):
        ops.rms_norm(x.float(), w.bfloat16(), EPS)


def random_gate_up(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[rows, 2 width] gate | up values of spread 4, seeded."""
    g = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(rows, 2 * width, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_silu_mul_equals_reference(ops, dtype, rows, width):
    gate_up = random_gate_up(rows, width, dtype, seed=rows * 7 + width)
    got = ops.silu_mul(gate_up)
    assert got.shape == (rows, width)
    assert_matches(got, silu_mul_reference(gate_up))


def gated_over_the_range(op) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001 - a torch.ops.brisk op
    """(gates from -120 to 120, op's float64 outputs for them with up = 1): one [1, 2I] row, gate = g, up = 1."""
    g = torch.linspace(-120, 120, 48_001)
    return g, op(torch.stack([g, torch.ones_like(g)]).reshape(1, -1))[0].double()


def test_silu_over_the_whole_float_range(ops):
    """The kernel's own exp: within a few float32 ulps of float64 silu from -120 to 120 (where e^-g overflows
    and e^g underflows), and exactly silu(0) = 0."""
    g, got = gated_over_the_range(ops.silu_mul)
    want = torch.nn.functional.silu(g.double())
    assert torch.isfinite(got).all()
    # relative 4 ulps (2^-21) where the value is a normal float; below g = -87.3 the kernel flushes e^g to 0,
    # an absolute error of at most 87.3 e^-87.3 ~ 1.1e-36
    torch.testing.assert_close(got, want, atol=1.2e-36, rtol=2**-21)
    assert ops.silu_mul(torch.zeros(1, 16))[0].abs().max() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_gelu_tanh_mul_equals_reference(ops, dtype, rows, width):
    gate_up = random_gate_up(rows, width, dtype, seed=rows * 5 + width)
    got = ops.gelu_tanh_mul(gate_up)
    want = gelu_tanh_mul_reference(gate_up)
    assert got.shape == want.shape == (rows, width) and got.dtype == want.dtype
    # PyTorch's 0.5 g (1 + tanh(u)) loses the small values of the far negative side to the cancellation in 1 + tanh
    # (absolute error ~|g| float32 ulp(1)); the kernel's g sigmoid(2u) keeps them: an absolute floor of 16 * 16 *
    # 2^-24 for |gate|, |up| <= ~16, else a few float32 ulps, or one bf16 ulp
    rtol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), atol=2e-5, rtol=rtol)


def test_gelu_tanh_over_the_whole_float_range(ops):
    """The kernel's gelu_tanh against float64 from -120 to 120, written as g sigmoid(z) with z = 2 sqrt(2 / pi)
    (g + 0.044715 g^3) (float64's own 1 + tanh cancels on the negative side): a few float32 ulps, plus what the
    float32 roundings of z (g^2, g^3, the fma, the product: 4) do to e^-|z| (|z| half-ulps each, the exponential's
    condition number), where the value is above 1e-30; below, the exponential flushes to 0 under e^-87.3, as
    silu's."""
    g, got = gated_over_the_range(ops.gelu_tanh_mul)
    g64 = g.double()
    z = (8 / torch.pi) ** 0.5 * (g64 + 0.044715 * g64**3)
    want = g64 * torch.sigmoid(z)
    assert torch.isfinite(got).all() and ops.gelu_tanh_mul(torch.zeros(1, 16)).abs().max() == 0
    big = want.abs() > 1e-30
    rel = (got - want).abs()[big] / want.abs()[big]
    assert (rel <= (8 + 4 * z.abs()[big]) * 2**-24).all(), rel.max()
    assert (got[~big] - want[~big]).abs().max() < 1e-28
    # and the public function: the kernel on the CPU, the reference without it
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(gelu_tanh_mul(x), gelu_tanh_mul_reference(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 7, 8, 100, 1 << 16 | 5])
def test_half_to_bfloat16_rounds_as_through_float(ops, n):
    # every float16 bit pattern once (normals, subnormals, zeros, infinities, NaNs), then random values
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    for src in (every[:n], every.roll(n)[-n:], (torch.randn(n) * 300).to(torch.float16)):
        dst = torch.empty(src.numel(), dtype=torch.bfloat16)
        ops.half_to_bfloat16(src, dst)
        want = src.float().to(torch.bfloat16)
        assert torch.equal(dst.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(dst[ok].view(torch.int16), want[ok].view(torch.int16))
    with pytest.raises(RuntimeError, match="dst must be contiguous bfloat16"):
        ops.half_to_bfloat16(torch.zeros(8, dtype=torch.float16), torch.zeros(9, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_path_equals_kernel_path(kernel_settings, ops, dtype):
    """The public functions, kernels on, then switched off: same values, same in-place contract."""
    x, residual, w = inputs(5, 100, dtype, seed=11)
    x = x.view(5, 1, 100)  # [..., H]: the wrappers flatten leading dims for the kernel
    residual = residual.view(5, 1, 100)
    gate_up = torch.randn(5, 1, 200).to(dtype)

    def run() -> tuple[torch.Tensor, ...]:
        r = residual.clone()
        normed, returned = add_rms_norm(x, r, w, EPS)
        assert returned is r  # the caller's residual tensor, updated in place, is what comes back
        return rms_norm(x, w, EPS), normed, r, silu_mul(gate_up)

    fast = run()
    kernel_settings(enabled=False)
    assert kernels.get_op("rms_norm") is None
    slow = run()
    for got, want in zip(fast, slow, strict=True):
        assert_matches(got, want)
    assert torch.equal(fast[2], slow[2]) and torch.equal(slow[2], residual + x)


def test_unsupported_inputs_take_the_reference_path(ops):
    x, residual, w = inputs(3, 64, torch.float32, seed=12)
    # float16, a non-contiguous x, a weight of another dtype: the kernel refuses them, the wrapper falls back
    half = x.half()
    torch.testing.assert_close(rms_norm(half, w.half(), EPS), rms_norm_reference(half, w.half(), EPS))
    strided = torch.randn(64, 3).t()  # [3, 64] view, rows not contiguous
    assert_matches(rms_norm(strided, w, EPS), rms_norm_reference(strided, w, EPS))
    mixed = rms_norm(x.bfloat16(), w, EPS)  # bf16 x, float32 weight: promoted to float32 as HF's module does
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, rms_norm_reference(x.bfloat16(), w, EPS))
    r = residual.clone()
    normed, returned = add_rms_norm(strided, r, w, EPS)  # the reference path keeps the in-place contract
    assert returned is r and torch.equal(r, residual + strided)
    assert_matches(normed, rms_norm_reference(residual + strided, w, EPS))
    gu = torch.randn(2, 8, 3).transpose(1, 2)  # [2, 3, 8], not contiguous
    assert_matches(silu_mul(gu), silu_mul_reference(gu))
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(x, w[:10], EPS)
    with pytest.raises(RuntimeError, match="must have one shape"):
        ops.add_rms_norm(x[:2], residual, w, EPS)


def test_model_with_kernels_on_and_off(kernel_settings, tmp_path, ops):
    """A whole tiny model (intermediate 100: silu_mul's tail) through both paths: close logits, same tokens."""
    make_tiny_hf_model(tmp_path, "llama", intermediate_size=100, seed=6)
    loaded = load_model(tmp_path)
    c = loaded.config
    ids = torch.randint(3, c.vocab_size, (24,), generator=torch.Generator().manual_seed(5))
    llm = LLM(str(tmp_path), max_model_len=128, kv_cache_memory="2MiB")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def logits_and_tokens() -> tuple[torch.Tensor, list[int]]:
        kv = [torch.zeros(2, 2, 16, c.num_key_value_heads, c.head_dim) for _ in range(c.num_hidden_layers)]
        meta = AttentionMetadata.for_sequences([24], [24], [[0, 1]], 16)
        with torch.inference_mode():
            logits = loaded.model(ids, torch.arange(24), meta, kv)
        return logits, llm.generate([ids[:8].tolist()], params)[0].outputs[0].token_ids

    fast_logits, fast_tokens = logits_and_tokens()
    kernel_settings(enabled=False)
    slow_logits, slow_tokens = logits_and_tokens()
    assert fast_logits.shape == (24, c.vocab_size)
    # float32 rounding differences through 2 layers (the attention and linear kernels differ as well)
    torch.testing.assert_close(fast_logits, slow_logits, atol=1e-4, rtol=1e-4)
    assert fast_tokens == slow_tokens


# ---- RoPE + KV-cache write (rope_cache) ----

def _rope_inputs(tokens: int, dtype: torch.dtype, h: int = 9, kvh: int = 3, d: int = 64, seed: int = 0):
    from brisk.model.config import ModelConfig
    from brisk.model.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    config = ModelConfig(architecture="llama", vocab_size=10, hidden_size=h * d, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=h, num_key_value_heads=kvh, head_dim=d,
                         max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=100000.0)
    rope = RotaryEmbedding(config, 4096, "cpu")
    positions = torch.randint(0, 4000, (tokens,), generator=g)
    cos, sin = rope.cos_sin(positions)
    qkv = (3 * torch.randn(tokens, (h + 2 * kvh) * d, generator=g)).to(dtype)
    cache = torch.zeros(2, 40, 16, kvh, d, dtype=dtype)
    slots = torch.randperm(40 * 16, generator=g)[:tokens]
    return qkv, cos, sin, cache, slots


def test_rope_positions_beyond_the_table_are_computed():
    """cos_sin looks positions up in its table and computes those past its end (a context longer than
    max_position_embeddings) from the frequencies, in one call with both kinds."""
    from brisk.model.config import ModelConfig
    from brisk.model.rope import RotaryEmbedding

    config = ModelConfig(architecture="llama", vocab_size=10, hidden_size=64, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0)
    rope = RotaryEmbedding(config, 128, "cpu")
    positions = torch.tensor([0, 127, 128, 1000])
    cos, sin = rope.cos_sin(positions)
    freqs = positions.double().unsqueeze(1) * rope.inv_freq.double().unsqueeze(0)
    torch.testing.assert_close(cos.double(), freqs.cos(), atol=1e-4, rtol=0)
    torch.testing.assert_close(sin.double(), freqs.sin(), atol=1e-4, rtol=0)
    assert torch.equal(rope.cos_sin(positions[:2])[0], rope.cos_table[:128][positions[:2]])


def _rope_cache_case(ops, tokens, dtype, cache_dtype, seed, h=9, kvh=3, d=64):
    """rope_cache on fresh inputs next to its reference (apply_rope, then write_kv into a copy of the cache).
    Returns (qkv after the kernel [T, h + 2 kvh, d], qkv before, reference q|k, cache, reference cache, slots)."""
    from brisk.model.rope import apply_rope
    from brisk.ops.attention import write_kv

    qkv, cos, sin, cache, slots = _rope_inputs(tokens, dtype, h, kvh, d, seed=seed)
    cache = cache.to(cache_dtype)
    view = qkv.view(tokens, h + 2 * kvh, d)
    want_qk = apply_rope(view[:, :h + kvh], cos, sin)
    want_cache = cache.clone()
    write_kv(want_cache, want_qk[:, h:], view[:, h + kvh:], slots)
    got = qkv.clone()
    ops.rope_cache(got, cos, sin, cache, slots, h, kvh)
    return got.view(tokens, h + 2 * kvh, d), view, want_qk, cache, want_cache, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rope_cache_is_bit_identical_to_apply_rope_and_write_kv(ops, dtype, tokens):
    h, kvh = 9, 3
    got, view, want_qk, cache, want_cache, _ = _rope_cache_case(ops, tokens, dtype, dtype, seed=tokens)
    assert torch.equal(got[:, :h + kvh], want_qk)  # q and k rotated in place, bit for bit
    assert torch.equal(got[:, h + kvh:], view[:, h + kvh:])  # v untouched
    assert torch.equal(cache, want_cache)  # the same cache slots hold the same rows; no other slot written


@pytest.mark.parametrize("tokens", [1, 300])
def test_rope_cache_into_a_bfloat16_cache_rounds_like_write_kv(ops, tokens):
    """float32 qkv, bfloat16 cache (--kv-cache-dtype bfloat16): q and k rotated in float32 in place; the cache
    gets k and v rounded to nearest even, exactly as write_kv's `.to(torch.bfloat16)`."""
    h, kvh, d = 9, 3, 64
    got, _, want_qk, cache, want_cache, slots = _rope_cache_case(ops, tokens, torch.float32, torch.bfloat16,
                                                                 seed=tokens + 7)
    assert torch.equal(got[:, :h + kvh], want_qk)
    assert torch.equal(cache, want_cache)
    assert not torch.equal(cache[0].view(-1, kvh, d)[slots].float(), want_qk[:, h:])  # it did round


def test_rope_cache_rejects_bad_inputs(ops):
    qkv, cos, sin, cache, slots = _rope_inputs(4, torch.float32)
    with pytest.raises(RuntimeError, match="outside the cache's 640 slots"):
        ops.rope_cache(qkv, cos, sin, cache, torch.tensor([0, 1, 2, 640]), 9, 3)
    with pytest.raises(RuntimeError, match="must be float32 / float32, bfloat16 / bfloat16 or float32 / bfloat16"):
        ops.rope_cache(qkv.bfloat16(), cos, sin, cache, slots, 9, 3)
    with pytest.raises(RuntimeError, match=r"qkv must be a contiguous \[tokens, 960\]"):
        ops.rope_cache(qkv[:, :900], cos, sin, cache, slots, 9, 3)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous float32"):
        ops.rope_cache(qkv, cos.double(), sin, cache, slots, 9, 3)
