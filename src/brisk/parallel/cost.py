"""A cost model of tensor- and pipeline-parallel decoding: per-rank roofline plus collectives (docs/parallel.md).

One engine step on one rank costs

    t_rank = host + max(bytes_r / BW_r, flops_r / F_r) + comm

    host      the rank's host time outside the weights: a part per step, on the driver only (scheduling,
              sampling), and a part per layer it runs (Python dispatch of the module path, attention, norms),
              each a fixed cost plus a cost per token of the step
    bytes_r   the weights the rank streams per step (its share of every layer's matmuls, its share of lm_head)
              plus the K/V its heads read
    flops_r   2 x (the rank's matmul parameters) x tokens in the step
    BW_r, F_r the memory bandwidth and matmul flop/s ONE rank reaches with its threads while every rank of its
              machine runs: on a machine of C cores, N ranks get C/N threads each, so BW_r and F_r are not the
              single process's (that is what `brisk bench parallel` measures, concurrently on every rank)

and the messages, collectives over a link of latency a and bandwidth b, point-to-point sends over a link of its
own (a', b'; the same link unless given: a collective library's all-reduce can cost several times its send):

    tensor parallel (N ranks)   2 all-reduces a layer (after o_proj and down_proj) of tokens x hidden activations,
                                ring: 2 (N-1) a + 2 (N-1)/N x bytes / b each; the logits gathered on rank 0:
                                (N-1) (a + tokens x vocab/N x 4 / b); the step's schedule sent to every worker:
                                (N-1) a'
    pipeline parallel (N stages) one send per stage boundary ([2, tokens, hidden]: x and the residual), a' + bytes / b',
                                the logits back from the last stage to rank 0, and the schedule to every stage;
                                the driver's host time a step falls on the first stage

Pipeline overlap: the engine keeps k = min(N, batch) micro-batches (of ceil(batch / k) requests) in flight. A round
that returns every request's next token then takes max(sum of the stage times, k x the slowest stage): one
micro-batch (batch 1) walks the stages one after another; N of them keep every stage busy.

tok/s = batch / step time (TP, one process) or batch / round time (PP). Speed-up = tok/s over the single
process's at the same batch, whose t = host + max(bytes / BW_1, flops / F_1) with the whole machine's threads.

Left out: attention flops (small beside the matmuls at short contexts), norms and rotary embeddings, and the
overlap of communication with compute (brisk's all-reduces are blocking).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from brisk.model.config import ModelConfig

MODES = ("single", "tp", "pp")


@dataclass(frozen=True)
class Link:
    """The wire between ranks: one message costs latency_s + bytes / bandwidth (bytes/s)."""

    latency_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth <= 0:
            raise ValueError(f"a link needs latency >= 0 and bandwidth > 0, got {self.latency_s} s and "
                             f"{self.bandwidth} bytes/s")


@dataclass(frozen=True)
class RankSpeed:
    """What one rank (or the single process) reaches: memory bandwidth (bytes/s), matmul flop/s, host seconds."""

    mem_bandwidth: float
    flops: float
    step_overhead_s: float = 0.0  # per engine step (the driver's)
    layer_overhead_s: float = 0.0  # per layer the rank runs, per step
    step_token_s: float = 0.0  # per engine step, per token of the step (the driver's)
    layer_token_s: float = 0.0  # per layer the rank runs, per token of the step

    def __post_init__(self) -> None:
        if self.mem_bandwidth <= 0 or self.flops <= 0:
            raise ValueError(f"a rank needs memory bandwidth and flop/s above 0, got {self.mem_bandwidth} and "
                             f"{self.flops}")
        if min(self.step_overhead_s, self.layer_overhead_s, self.step_token_s, self.layer_token_s) < 0:
            raise ValueError("host overheads cannot be negative")

    def host_s(self, num_layers: float, tokens: int, driver: bool = True) -> float:
        """Host seconds of a step of `tokens` tokens through `num_layers` layers; the per-step part on the driver."""
        step = self.step_overhead_s + self.step_token_s * tokens if driver else 0.0
        return step + num_layers * (self.layer_overhead_s + self.layer_token_s * tokens)


@dataclass(frozen=True)
class ModelShape:
    """The sizes the cost model needs, from a ModelConfig: matmul parameters per layer and of lm_head."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    layer_params: int  # q, k, v, o, gate, up, down of one layer
    head_params: int  # lm_head: vocab x hidden
    kv_values_per_token: int  # K and V values one token keeps per layer: 2 x kv_heads x head_dim

    @classmethod
    def from_config(cls, config: ModelConfig, name: str = "") -> ModelShape:
        h, d = config.hidden_size, config.head_dim
        attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)  # q, o; k, v
        mlp = 3 * h * config.intermediate_size  # gate, up, down
        return cls(name or "model", config.num_hidden_layers, h, config.vocab_size, attn + mlp,
                   config.vocab_size * h, 2 * config.num_key_value_heads * d)

    @property
    def matmul_params(self) -> int:
        return self.num_layers * self.layer_params + self.head_params


def model_shape(model: str | Path | ModelConfig) -> ModelShape:
    """A ModelConfig, a named dummy shape (model/dummy.py SHAPES) or an HF config.json -> its ModelShape."""
    if isinstance(model, ModelConfig):
        return ModelShape.from_config(model)
    from brisk.model.dummy import shape_config

    return ModelShape.from_config(shape_config(model), name=str(model))


# ---------------------------------------------------------------------------- collectives
def all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce of nbytes on every rank: 2 (N-1) steps of nbytes / N each (reduce-scatter, all-gather)."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) * link.latency_s + 2 * (ranks - 1) / ranks * nbytes / link.bandwidth


def send_s(nbytes: float, link: Link) -> float:
    return link.latency_s + nbytes / link.bandwidth


def gather_s(nbytes_per_rank: float, ranks: int, link: Link) -> float:
    """Every other rank's piece into rank 0, over rank 0's one link."""
    return (ranks - 1) * send_s(nbytes_per_rank, link) if ranks > 1 else 0.0


def roofline_s(nbytes: float, flops: float, speed: RankSpeed) -> float:
    return max(nbytes / speed.mem_bandwidth, flops / speed.flops)


# ---------------------------------------------------------------------------- one step
@dataclass(frozen=True)
class Prediction:
    mode: str
    ranks: int
    batch: int
    compute_s: float  # the slowest rank's roofline (TP: every rank's; PP: the slowest stage's, one micro-batch)
    host_s: float  # that rank's host time
    comm_s: float  # collectives on the critical path (PP: per micro-batch hand-offs of the slowest stage)
    step_s: float  # seconds for every request of the batch to get one token (PP: one round)
    tok_s: float
    read_bytes_per_rank: float  # the largest rank's bytes read a step (weights, K/V)

    def to_dict(self) -> dict[str, float | int | str]:
        from dataclasses import asdict

        return asdict(self)


def predict(model: ModelShape, mode: str, ranks: int, batch: int, speed: RankSpeed, link: Link | None = None,
            bytes_per_param: float = 2.0, act_bytes: int = 4, kv_bytes: int = 2, context: int = 0,
            p2p: Link | None = None) -> Prediction:
    """Predicted decode step (see the module docstring) of `batch` requests, each attending to `context` positions.

    `speed` is one rank's (for "single": the whole process's); `bytes_per_param` the weights' storage (2 for
    bf16, about 0.56 for 4-bit with group-64 scales); `act_bytes` the activations' dtype on the wire; `link` the
    collectives', `p2p` the point-to-point sends' (default: `link`)."""
    if mode not in MODES:
        raise ValueError(f"unknown parallel mode {mode!r}: use one of {', '.join(MODES)}")
    if ranks < 1 or batch < 1:
        raise ValueError(f"ranks and batch must be at least 1, got {ranks} and {batch}")
    if mode == "single" and ranks != 1:
        raise ValueError(f"a single process has 1 rank, got {ranks}")
    if mode != "single" and link is None:
        raise ValueError(f"mode {mode!r} needs a Link (latency, bandwidth)")
    if mode == "pp" and ranks > model.num_layers:
        raise ValueError(f"{model.num_layers} layers cannot be split into {ranks} pipeline stages")
    layer_bytes = model.layer_params * bytes_per_param
    head_bytes = model.head_params * bytes_per_param
    kv_layer = model.kv_values_per_token * kv_bytes * context  # one request, one layer

    def rank_s(num_layers: float, share: float, head: float, tokens: int, driver: bool = True
               ) -> tuple[float, float, float]:
        nbytes = num_layers * (layer_bytes + kv_layer * tokens) * share + head * head_bytes
        flops = 2 * tokens * (num_layers * model.layer_params * share + head * model.head_params)
        return roofline_s(nbytes, flops, speed), speed.host_s(num_layers, tokens, driver), nbytes

    if mode in ("single", "tp"):
        compute, host, nbytes = rank_s(model.num_layers, 1 / ranks, 1 / ranks, batch)
        comm = 0.0
        if mode == "tp":
            assert link is not None
            comm = (2 * model.num_layers * all_reduce_s(batch * model.hidden_size * act_bytes, ranks, link)
                    + gather_s(batch * model.vocab_size / ranks * 4, ranks, link)
                    + (ranks - 1) * (p2p or link).latency_s)  # the schedule to every worker
        step = host + compute + comm
        return Prediction(mode, ranks, batch, compute, host, comm, step, batch / step, nbytes)

    assert link is not None
    wire = p2p or link
    k = min(ranks, batch)  # micro-batches in flight
    m = math.ceil(batch / k)  # requests per micro-batch
    stage_layers = [len(range(s, model.num_layers, ranks)) for s in range(ranks)]  # sizes differ by at most one
    stages = []
    for s, num_layers in enumerate(stage_layers):
        last = s == ranks - 1
        compute, host, nbytes = rank_s(num_layers, 1.0, 1.0 if last else 0.0, m, driver=s == 0)
        out = m * model.vocab_size * 4 if last else 2 * m * model.hidden_size * act_bytes  # logits | (x, residual)
        sends = send_s(out, wire) + ((ranks - 1) * wire.latency_s if s == 0 else 0.0)  # (+ the schedule)
        stages.append((host + compute + sends, compute, host, sends, nbytes))
    round_s = max(sum(st[0] for st in stages), k * max(st[0] for st in stages))
    slow = max(stages, key=lambda st: st[0])
    return Prediction(mode, ranks, batch, slow[1], slow[2], slow[3], round_s, batch / round_s,
                      max(st[4] for st in stages))


def speedup(model: ModelShape, mode: str, ranks: int, batch: int, single: RankSpeed, rank: RankSpeed, link: Link,
            **kw: Any) -> float:
    """tok/s of `mode` on `ranks` over the single process's, at the same batch."""
    ours = predict(model, mode, ranks, batch, rank, link, **kw)
    base = predict(model, "single", 1, batch, single, **kw)
    return ours.tok_s / base.tok_s


def prediction_rows(model: ModelShape, ranks: int, batches: tuple[int, ...], single: RankSpeed, rank: RankSpeed,
                    link: Link, **kw: Any) -> list[dict[str, float | int | str]]:
    """For each batch: the single process's, TP's and PP's predictions on `ranks`, each with its speed-up."""
    rows = []
    for b in batches:
        base = predict(model, "single", 1, b, single, **kw)
        for mode in MODES:
            p = base if mode == "single" else predict(model, mode, ranks, b, rank, link, **kw)
            rows.append({**p.to_dict(), "speedup": p.tok_s / base.tok_s})
    return rows
