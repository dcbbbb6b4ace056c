"""The measurements behind `brisk bench parallel`: the link, per-rank compute and end-to-end decode.

Two parts, run one after the other:

  * probes: N ranks of our own (torch.multiprocessing, spawn; gloo on 127.0.0.1), every rank with threads // N
    torch threads, all at once (the way a parallel engine's ranks share the machine):
        all_reduce and send/recv of float32 messages of one hidden-state row, a decode batch's rows and a prefill
        chunk's
        (mean of repeats; the link's latency and bandwidth are fitted to the all-reduce's smallest and largest);
        memory read bandwidth and matmul flop/s of one rank (the cost model's BW_r, F_r);
        the per-rank compute of the model cut as tensor parallelism (shard_model) and pipeline parallelism
        (take_stage) cut it: every linear layer of the rank's share (and its lm_head share) run on a decode step's
        rows and on a prefill chunk's, without their collectives (the matmuls the rank does; attention over the
        context, norms and rotary embeddings left out)
  * decode: the real engines, one after another (single process, tensor parallel, pipeline parallel), each at
    batch 1 and batch B: decode tokens/s, and every rank's weight bytes.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def _times(fn: Any, reps: int) -> list[float]:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _median_s(fn: Any, reps: int) -> float:
    return statistics.median(_times(fn, reps))


def _link_probe(rank: int, hidden: int, vocab: int, rows: tuple[int, ...], reps: int
                ) -> dict[str, list[dict[str, float]]]:
    """The messages the parallel engine sends, every rank running it, each call after a small matmul (as in a
    forward, where a rank computes between its collectives): all_reduce of rows x hidden; gather to rank 0 of rows
    x vocab/N (tensor parallelism's logits); send rank 0 -> 1 (blocking, one way, the receiver waiting) of
    [2, rows, hidden] (a pipeline stage's hand-off) and of rows x vocab (the last stage's logits)."""
    world = dist.get_world_size()
    w = torch.randn(hidden, 4 * hidden)
    busy = torch.randn(8, hidden)
    out: dict[str, list[dict[str, float]]] = {"all_reduce": [], "gather": [], "send_recv": []}

    def timed(fn: Any) -> float:
        dist.barrier()
        fn()
        total = 0.0
        for _ in range(reps):
            torch.mm(busy, w)
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        return total / reps

    for n in rows:
        x = torch.randn(n, hidden)
        out["all_reduce"].append({"rows": n, "bytes": x.numel() * 4, "seconds": timed(lambda x=x: dist.all_reduce(x))})
    decode_rows = sorted({1, max(rows[:-1] or rows)})  # the decode batches (the last row count: the prefill chunk)
    for n in decode_rows:
        x = torch.randn(n, max(1, vocab // world))
        parts = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
        out["gather"].append({"rows": n, "bytes": x.numel() * 4,
                              "seconds": timed(lambda x=x, parts=parts: dist.gather(x, parts, dst=0))})
    for shape in [(2, n, hidden) for n in rows] + [(n, vocab) for n in decode_rows]:
        x = torch.randn(*shape)

        def one_way(x: torch.Tensor = x) -> None:
            if rank == 0:
                dist.send(x, 1)
            elif rank == 1:
                dist.recv(x, 0)

        out["send_recv"].append({"rows": shape[-2], "bytes": x.numel() * 4, "seconds": timed(one_way)})
    return out


def _speed_probe(reps: int) -> dict[str, float]:
    """One rank's read bandwidth (bytes/s) and float32 matmul flop/s, every rank at once."""
    from brisk.bench.membw import measure_membw

    dist.barrier()
    bw = measure_membw(64 << 20, runs=max(3, reps // 4)).read_gbps * 1e9
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    dist.barrier()
    s = _median_s(lambda: a @ b, reps)
    return {"mem_bandwidth": bw, "flops": 2 * 512 * 1024 * 1024 / s}


def _linears(model: Any) -> list[tuple[torch.nn.Module, int]]:
    """Every linear of the (cut) model with its input width, in forward order; a row-parallel layer's inner slice
    (its all-reduce left out), the vocabulary-parallel head's slice."""
    from brisk.parallel.shard import ParallelLMHead, RowParallelLinear

    c = model.config
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.qkv_proj] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
        o, down = attn.o_proj, mlp.down_proj
        o = o.inner if isinstance(o, RowParallelLinear) else o
        down = down.inner if isinstance(down, RowParallelLinear) else down
        out += [(m, c.hidden_size) for m in qkv]
        out.append((o, attn.num_heads * c.head_dim))
        out += [(m, c.hidden_size) for m in gate_up]
        out.append((down, c.intermediate_size))
    head = model.lm_head
    if head is not None:
        out.append((head.inner if isinstance(head, ParallelLMHead) else head, c.hidden_size))
    return out


def linear_bytes(model: Any) -> int:
    """Bytes of the tensors of the model's linears (`_linears`): what a decode step streams through them."""
    seen: set[int] = set()
    total = 0
    for m, _ in _linears(model):
        for t in list(m.parameters()) + list(m.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def time_linears(model: Any, dtype: torch.dtype, rows: tuple[int, ...], reps: int, barrier: bool = False
                 ) -> dict[str, float]:
    """Median seconds of one pass over the model's linears (`_linears`) on n random rows, for each n in `rows`."""
    linears = _linears(model)
    times = {}
    with torch.inference_mode():
        for n in rows:
            inputs = [(m, torch.randn(n, k, dtype=dtype)) for m, k in linears]

            def run(inputs: list[tuple[torch.nn.Module, torch.Tensor]] = inputs) -> None:
                for m, x in inputs:
                    m(x)

            if barrier:
                dist.barrier()
            times[str(n)] = _median_s(run, reps)
    return times


def _compute_probe(engine_kw: dict[str, Any], rank: int, world: int, rows: tuple[int, ...], reps: int
                   ) -> dict[str, Any]:
    """Seconds of this rank's linears at each row count, model cut for TP and for PP; the layers it holds."""
    from brisk.engine.llm_engine import load_engine_model
    from brisk.engine.memory import weight_bytes
    from brisk.engine.settings import build_engine_config
    from brisk.parallel.comm import Group
    from brisk.parallel.pipeline import stage_layers, take_stage
    from brisk.parallel.shard import shard_model

    config = build_engine_config(**engine_kw)
    out: dict[str, Any] = {}
    for mode in ("tp", "pp"):
        loaded = load_engine_model(config)
        model, dtype = loaded.model, loaded.dtype
        if mode == "tp":
            shard_model(model, Group(rank, world))  # its collectives are never called here
        else:
            take_stage(model, stage_layers(model.config.num_hidden_layers, world)[rank], rank, world)
        times = time_linears(model, dtype, rows, reps, barrier=True)
        out[mode] = {"seconds": times, "num_layers": len(model.model.layers), "weight_bytes": weight_bytes(model),
                     "linear_bytes": linear_bytes(model)}
        del model, loaded
    return out


def _probe_main(rank: int, world: int, port: int, threads: int, engine_kw: dict[str, Any], hidden: int,
                vocab: int, rows: tuple[int, ...], reps: int, link_reps: int, queue: Any) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {"rank": rank, "threads": threads, **_link_probe(rank, hidden, vocab, rows, link_reps),
                  **_speed_probe(reps), "compute": _compute_probe(engine_kw, rank, world, rows, reps)}
        queue.put(result)
    except BaseException as e:
        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        dist.destroy_process_group()


def run_probes(engine_kw: dict[str, Any], world: int, threads: int, hidden: int, vocab: int, rows: tuple[int, ...],
               reps: int, link_reps: int, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Every rank's probe results (see the module docstring), in rank order."""
    import torch.multiprocessing as mp

    from brisk.parallel.launch import _free_port, stop_processes

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_probe_main, daemon=True,
                         args=(r, world, port, threads, engine_kw, hidden, vocab, rows, reps, link_reps, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(world):
            results.append(queue.get(timeout=timeout))
    finally:
        stop_processes(procs)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"a probe rank failed: {'; '.join(errors)}")
    return sorted(results, key=lambda r: r["rank"])


# ---------------------------------------------------------------------------- end-to-end decode
@dataclass
class DecodeRun:
    batch: int
    decode_tokens: int  # tokens produced after every request had its first one
    decode_s: float
    steps: int = 0  # engine steps in decode_s
    forward_s: float = 0.0  # of decode_s, inside the model's forward (a one-process engine's runner; else 0)

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_s


def run_decode(llm: Any, batch: int, input_len: int, output_len: int, seed: int = 0) -> DecodeRun:
    """`batch` greedy requests of random `input_len`-token prompts, `output_len` tokens each, added at once; the
    decode rate counts from the step after which every request had its first token to the last step."""
    from brisk.engine.sampling_params import SamplingParams

    engine = llm.engine
    vocab = min(engine.loaded.config.vocab_size, llm.get_tokenizer().vocab_size)
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(None, torch.randint(3, vocab, (input_len,), generator=g).tolist(), params)
    started: set[str] = set()
    t0, count, steps, forward_s = None, 0, 0, 0.0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        if t0 is not None:
            steps += 1
            forward_s += getattr(engine.runner, "last_timing", (0.0, 0.0, 0.0))[1]
        for out in outs:
            new = out.outputs[0].num_new_tokens
            if t0 is not None:
                count += new
            started.add(out.request_id)
        if t0 is None and len(started) == batch:
            t0 = now
    if t0 is None or count == 0:
        raise ValueError(f"--output-len {output_len} leaves no decode steps to time; use at least 2")
    return DecodeRun(batch, count, now - t0, steps, forward_s)


def threads_default() -> int:
    return torch.get_num_threads() or os.cpu_count() or 1
