"""The layer-wise calibration driver shared by GPTQ, AWQ, SparseGPT and Wanda, and its observers.

Calibrated methods look at what each linear layer actually receives. Running the whole model on the calibration
set at once would keep every layer's activations alive, so the driver walks the decoder one block at a time
(the GPTQ recipe), holding only one block's inputs and outputs:

    ids [N, L] --embed--> h_0 [N, L, hidden]
    for block i:   apply(ctx)                    the method: observe the block's linears, change weights,
                                                 run the block again if it wants (ctx.observe / ctx.forward)
                   h_{i+1} = block_i(h_i)        re-run on the *modified* weights, so block i+1 is calibrated on
                                                 what it will really receive after block i is compressed

Public API (stable; other methods code against it):

- `CalibConfig(calib_text, num_samples=16, seq_len=256, seed=0, batch_size=8)`: validated; `to_dict()` is what a
  checkpoint's quantization_config records under "calibration".
- `load_calibration_ids(tokenizer, config) -> LongTensor [num_samples, seq_len]`: seeded random windows of the
  tokenized text (no special tokens, like the perplexity protocol). Raises CalibrationError for a text too short.
- `run_layerwise(model, ids, apply, batch_size=8, progress=True, label="calibrate", moe_experts=False) -> None`:
  the driver above. `model` must be UNFUSED (load_model(..., fuse=False)) so q/k/v and gate/up are separate
  linears. A MoE model is refused unless `moe_experts` (the method handles routed experts: each expert's hooks
  see only the rows routed to it; Wanda and SparseGPT do, prune/unstructured.py).
- `BlockContext` (what `apply` gets), for block `ctx.index` of `ctx.num_blocks`:
    ctx.block, ctx.prefix ("model.layers.3"), ctx.inputs [N, L, hidden] (the block's input hidden states),
    ctx.linears() -> {short name: nn.Linear} in forward order ("self_attn.q_proj", ..., "mlp.down_proj"),
    ctx.observe(names, make_observer) -> {short name: observer}: runs every sample through the block with the
        current weights, feeding each named linear's input x [T, in_features] to `make_observer(name, linear)`'s
        `update(x)`; linears that receive the same tensor (q/k/v, gate/up) share ONE observer. The forward
        stops early once the last named linear has run (observing q/k/v costs one RMSNorm, not the block).
    ctx.forward() -> [N, L, hidden]: the block's output hidden states with the current weights,
    ctx.run(fn) -> list of fn's results: calls fn(block, x, cos, sin, meta, kv_cache) per mini-batch, x being
        that mini-batch's input hidden states [T, hidden] (for methods that run a sub-module, e.g. self_attn),
    ctx.status(text): shown on the progress bar next to the block number.
- `TRUE_SEQUENTIAL`: the stages of GPTQ's true-sequential order; `stages(ctx)` filters them to ctx.linears().
- Observers (anything with `update(x: [T, K])` works):
    HessianObserver(K): H = 2/n sum_t x_t x_tᵀ (`hessian()` float32 [K, K], `num_tokens`),
    ActStatsObserver(K): per input channel `mean_abs()` (AWQ's s_x) and `sq_norm()` = sum_t x_t² (Wanda's
        ||X_j||², unnormalised like Wanda), `num_tokens`,
    CombinedObserver(*observers): feeds several from one hook.

Numerics: each mini-batch's xᵀx is one float32 GEMM (fast BLAS; a mini-batch is at most a few thousand tokens,
so a float32 dot product over it keeps ~1e-7 relative error), and the sum over mini-batches is kept in float64 so
that it neither drifts nor depends on the batch split when many batches are added; the result is returned in
float32, the precision the GPTQ/SparseGPT solvers use (after dampening).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from brisk.model.llama import DecoderLayer, LlamaForCausalLM
from brisk.model.tokenizer import Tokenizer
from brisk.ops.attention import AttentionMetadata

# GPTQ's true-sequential order (its LLaMA script): each stage is quantized on inputs recomputed after the
# stages before it were quantized
TRUE_SEQUENTIAL: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


class CalibrationError(ValueError):
    """Calibration settings or data that cannot work (a missing or too short text, a fused model, ...)."""


@dataclass(frozen=True)
class CalibConfig:
    calib_text: str  # path of a UTF-8 text file
    num_samples: int = 16  # 16 x 256 tokens: ~2.5-3 CPU-minutes of GPTQ/AWQ on the default model
    seq_len: int = 256
    seed: int = 0
    batch_size: int = 8  # samples per forward mini-batch: bounds the activations of one block run

    def __post_init__(self) -> None:
        for name in ("num_samples", "seq_len", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CalibrationError(f"{name} must be a positive integer, got {value!r}")
        if self.seq_len < 2:
            raise CalibrationError(f"seq_len must be at least 2 tokens, got {self.seq_len}")

    def to_dict(self) -> dict[str, Any]:
        """What a checkpoint records: the text's file name (not the local path), count, length and seed."""
        d = asdict(self)
        d.pop("batch_size")  # changes memory use, not the result
        d["calib_text"] = Path(self.calib_text).name
        return d


def load_calibration_ids(tokenizer: Tokenizer, config: CalibConfig) -> torch.Tensor:
    """`num_samples` windows of `seq_len` token ids [N, L] (int64) at seeded random offsets of the text.

    The whole text is tokenized once with no special tokens (as the perplexity protocol does), then each window
    starts at a uniformly drawn offset (GPTQ's loader draws random windows the same way). Windows may overlap
    when the text is short; the same (text, N, L, seed) always gives the same ids.
    """
    path = Path(config.calib_text)
    if not path.is_file():
        raise CalibrationError(f"calibration text {path} does not exist; pass --calib-text with a UTF-8 text file "
                               "(the default is the bundled calibration text, brisk.data.calibration_text_path())")
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
    if len(ids) < config.seq_len:
        raise CalibrationError(f"calibration text {path.name} has {len(ids)} tokens, fewer than one sample of "
                               f"--seq-len {config.seq_len}; pass a longer text or a shorter --seq-len")
    gen = torch.Generator().manual_seed(config.seed)
    starts = torch.randint(0, len(ids) - config.seq_len + 1, (config.num_samples,), generator=gen)
    all_ids = torch.tensor(ids, dtype=torch.long)
    offsets = starts[:, None] + torch.arange(config.seq_len)  # [N, L]
    return all_ids[offsets]


# ---------------------------------------------------------------------------------------------------------
# observers


class Observer(Protocol):
    def update(self, x: torch.Tensor) -> None:
        """x: [T, in_features], one mini-batch of a linear layer's inputs."""


class HessianObserver:
    """H = 2/n sum_t x_t x_tᵀ over all tokens seen: the Hessian of ||W X - Ŵ X||² (GPTQ, SparseGPT)."""

    def __init__(self, in_features: int) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.num_tokens = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [T, K]
        self.sum += (x.t() @ x).double()  # float32 GEMM per batch, float64 running sum (see module docstring)
        self.num_tokens += x.shape[0]

    def hessian(self) -> torch.Tensor:
        assert self.num_tokens > 0, "no inputs observed"
        return (self.sum * (2.0 / self.num_tokens)).float()


class ActStatsObserver:
    """Per input channel: mean |x| (AWQ's activation magnitude s_x) and sum x² (Wanda's ||X_j||²)."""

    def __init__(self, in_features: int) -> None:
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.sq_sum = torch.zeros(in_features, dtype=torch.float64)
        self.num_tokens = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [T, K]
        self.abs_sum += x.abs().sum(0).double()
        self.sq_sum += x.square().sum(0).double()
        self.num_tokens += x.shape[0]

    def mean_abs(self) -> torch.Tensor:
        assert self.num_tokens > 0, "no inputs observed"
        return (self.abs_sum / self.num_tokens).float()

    def sq_norm(self) -> torch.Tensor:
        return self.sq_sum.float()


class CombinedObserver:
    """Several observers fed by one hook; `observers[i]` are the parts, in order."""

    def __init__(self, *observers: Observer) -> None:
        self.observers = observers

    def update(self, x: torch.Tensor) -> None:
        for o in self.observers:
            o.update(x)


# ---------------------------------------------------------------------------------------------------------
# the driver


class _StopForward(Exception):  # noqa: N818 - control flow, not an error
    """Raised by the last observer hook of a partial forward: the rest of the block is not needed."""


@dataclass
class _Batch:
    """What a block forward needs for one mini-batch of B samples of length L (T = B * L rows)."""

    rows: slice  # which samples of ctx.inputs
    cos: torch.Tensor  # [T, d/2]
    sin: torch.Tensor
    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [2, B, L, kvh, d]: written by attention, never read back (no prior context)


class BlockContext:
    """One decoder block and its calibration inputs; the handle a method's `apply` works through."""

    def __init__(self, model: LlamaForCausalLM, index: int, inputs: torch.Tensor, batch_size: int,
                 set_status: Callable[[str], None]) -> None:
        self.model = model
        self.index = index
        self.num_blocks = len(model.model.layers)
        self.block: DecoderLayer = model.model.layers[index]
        self.prefix = f"model.layers.{index}"
        self.inputs = inputs  # [N, L, hidden]
        self.batch_size = batch_size
        self._set_status = set_status

    def status(self, text: str) -> None:
        self._set_status(text)

    def linears(self) -> dict[str, nn.Linear]:
        """Short name ("self_attn.q_proj") -> linear layer, in forward order."""
        return {name: m for name, m in self.block.named_modules() if isinstance(m, nn.Linear)}

    def _batches(self) -> Iterator[_Batch]:
        n, seq_len, _ = self.inputs.shape
        config, rope = self.model.config, self.model.rope
        assert rope is not None, "the model's RoPE is not initialised (load it with load_model)"
        for start in range(0, n, self.batch_size):
            b = min(self.batch_size, n - start)
            positions = torch.arange(seq_len).repeat(b)  # [T]: every sample starts at position 0
            context_lens = torch.full_like(positions, seq_len) if rope.length_dependent else None
            cos, sin = self.model.cos_sin(positions, context_lens)  # the model's tables (gemma3: two)
            # plain causal prefill of b independent sequences, no prior KV, one block of seq_len slots each
            meta = AttentionMetadata.for_sequences([seq_len] * b, [seq_len] * b, [[i] for i in range(b)], seq_len,
                                                   sliding_window=config.sliding_window)
            kv = torch.empty(2, b, seq_len, config.num_key_value_heads, config.head_dim, dtype=self.inputs.dtype)
            yield _Batch(slice(start, start + b), cos, sin, meta, kv)

    def run(self, fn: Callable[..., Any]) -> list[Any]:
        """fn(block, x [T, hidden], cos, sin, meta, kv_cache) for every mini-batch; returns the results."""
        out = []
        with torch.no_grad():
            for batch in self._batches():
                x = self.inputs[batch.rows].reshape(-1, self.inputs.shape[-1])  # [B*L, hidden]
                out.append(fn(self.block, x, batch.cos, batch.sin, batch.meta, batch.kv_cache))
        return out

    def forward(self) -> torch.Tensor:
        """Output hidden states [N, L, hidden] of the block with its current weights."""
        def block_out(block: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      meta: AttentionMetadata, kv: torch.Tensor) -> torch.Tensor:
            # residual None: the block treats x as the whole residual stream and updates it in place (a clone)
            y, residual = block(x.clone(), None, cos, sin, meta, kv)
            return y + residual  # [T, hidden]: the hidden state the next block starts from
        outs = self.run(block_out)
        return torch.cat(outs).view(self.inputs.shape)

    def observe(self, names: Sequence[str], make_observer: Callable[[str, nn.Linear], Observer]
                ) -> dict[str, Observer]:
        """Run the samples through the block, feeding each named linear's inputs to its own observer.

        Linears that receive the very same input tensor (q/k/v after one norm; gate/up) share the first one's
        observer, so a Hessian is accumulated once per distinct input. The forward stops after the last named
        linear (in forward order) has run.
        """
        linears = self.linears()
        unknown = [n for n in names if n not in linears]
        assert not unknown, f"{self.prefix} has no linear {unknown} (is the model fused? load it with fuse=False)"
        order = [n for n in linears if n in names]
        last = order[-1]
        observers: dict[str, Observer] = {n: make_observer(n, linears[n]) for n in order}
        # sharing is found on the first mini-batch by object identity (q/k/v are called on the same tensor);
        # `seen` holds those tensors until the batch ends, so a freed input's memory cannot alias a later one
        aliases: dict[str, str] = {}  # linear -> the earlier linear whose input it shares
        seen: list[tuple[torch.Tensor, str]] = []
        first_batch = True

        def hook_for(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
            def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
                x = args[0]
                if first_batch:
                    owner = next((n for t, n in seen if t is x), None)
                    if owner is None:
                        seen.append((x, name))
                    else:
                        aliases[name] = owner
                if name not in aliases:
                    observers[name].update(x.reshape(-1, x.shape[-1]))  # [T, in_features]
                if name == last:
                    raise _StopForward
            return hook

        handles = [linears[n].register_forward_pre_hook(hook_for(n)) for n in order]
        try:
            with torch.no_grad():
                for batch in self._batches():
                    x = self.inputs[batch.rows].reshape(-1, self.inputs.shape[-1])  # [B*L, hidden]
                    try:
                        self.block(x.clone(), None, batch.cos, batch.sin, batch.meta, batch.kv_cache)
                    except _StopForward:
                        pass
                    first_batch = False
                    seen.clear()
        finally:
            for h in handles:
                h.remove()
        for name, owner in aliases.items():
            observers[name] = observers[owner]
        return observers


def stages(ctx: BlockContext) -> list[tuple[str, ...]]:
    """TRUE_SEQUENTIAL restricted to the linears this block has (empty stages dropped)."""
    present = ctx.linears()
    out = [tuple(n for n in stage if n in present) for stage in TRUE_SEQUENTIAL]
    return [s for s in out if s]


@contextmanager
def _progress(label: str, total: int, enabled: bool) -> Iterator[tuple[Callable[[str], None], Callable[[], None]]]:
    """(set_status, advance) of a rich progress bar over blocks; no-ops when disabled."""
    if not enabled:
        yield (lambda _text: None), (lambda: None)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"[bold]{label}[/] block"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), transient=False) as bar:
        task = bar.add_task("", total=total)
        yield (lambda text: bar.update(task, description=text)), (lambda: bar.advance(task))


def run_layerwise(model: LlamaForCausalLM, ids: torch.Tensor, apply: Callable[[BlockContext], None],
                  batch_size: int = 8, progress: bool = True, label: str = "calibrate", moe_experts: bool = False
                  ) -> None:
    """Walk the decoder block by block: apply(ctx) may observe and change the block's weights; the block is then
    re-run on its modified weights to give the next block's inputs. ids: [N, L] calibration token ids.

    moe_experts: the method handles routed experts (a MoE model is refused otherwise). An expert's linears are
    hooked like any other, so its observer sees exactly the rows the router sent to it (possibly none)."""
    if ids.dim() != 2:
        raise CalibrationError(f"calibration ids must be [num_samples, seq_len], got shape {tuple(ids.shape)}")
    if model.config.is_moe and not moe_experts:
        raise CalibrationError(f"calibrated quantization (GPTQ, AWQ, SmoothQuant, LLM.int8) does not handle the "
                               f"routed experts of a mixture-of-experts model ({model.config.architecture}) yet: each "
                               "expert would need the statistics of the tokens routed to it; use --method rtn")
    if any(layer.self_attn.qkv_proj is not None or getattr(m, "gate_up_proj", None) is not None
           for layer in model.model.layers for m in layer.mlp.modules()):  # the MLP, or a MoE block's experts
        raise CalibrationError("the model has fused q/k/v or gate/up projections; calibrate a model loaded with "
                               "load_model(..., fuse=False)")
    with torch.no_grad():
        hidden = model.embed(ids)  # [N, L, hidden]: block 0's input (gemma3: scaled)
    num_blocks = len(model.model.layers)
    with _progress(label, num_blocks, progress) as (set_status, advance):
        for i in range(num_blocks):
            def status(text: str, i: int = i) -> None:
                set_status(f"{i + 1}/{num_blocks} {text}")
            ctx = BlockContext(model, i, hidden, batch_size, status)
            apply(ctx)
            status("forward")
            hidden = ctx.forward()  # the next block's input, through the modified weights
            advance()
