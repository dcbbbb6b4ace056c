"""`brisk bench parallel`: the link, per-rank compute and decode tok/s of single process, TP and PP, against the cost
model (parallel/cost.py) fitted to this machine's measurements (bench/parallel.py; docs/parallel.md)."""

from __future__ import annotations

from typing import Any

import click
import torch
from rich.console import Console
from rich.table import Table

from brisk.bench import report
from brisk.bench.options import build_llm, describe_model, engine_flags, set_threads


def fit_link(points: list[dict[str, float]]) -> dict[str, float]:
    """Latency = the smallest message's one-way seconds; bandwidth = the extra bytes of the largest over its extra
    seconds (least sensitive to the fixed cost)."""
    small, big = points[0], points[-1]
    extra_s = big["seconds"] - small["seconds"]
    bw = (big["bytes"] - small["bytes"]) / extra_s if extra_s > 0 else big["bytes"] / big["seconds"]
    return {"latency_s": small["seconds"], "bandwidth": bw}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _predictions(shape: Any, single_t: dict[str, float], single_compute: dict[str, float],
                 probes: list[dict[str, Any]], link: Any, batches: tuple[int, ...], prefill: int,
                 bytes_per_param: float, single_linear_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The cost model fitted here: effective bandwidth and flop/s of the linears (decode rows, prefill rows) from
    the compute probes, host seconds a step from the single process (its measured step minus its linears)."""
    from brisk.parallel.cost import RankSpeed, predict

    flops_prefill = 2 * shape.matmul_params * prefill
    single_speed = RankSpeed(single_linear_bytes / single_compute["1"], flops_prefill / single_compute[str(prefill)])
    speeds: dict[str, Any] = {"single": single_speed}
    for mode in ("tp", "pp"):
        # the ranks' mean: each rank's linear bytes over its decode seconds; its flops over its prefill seconds
        bws = [p["compute"][mode]["linear_bytes"] / p["compute"][mode]["seconds"]["1"] for p in probes]
        share = [p["compute"][mode]["linear_bytes"] / single_linear_bytes for p in probes]
        fls = [flops_prefill * sh / p["compute"][mode]["seconds"][str(prefill)]
               for sh, p in zip(share, probes, strict=True)]
        speeds[mode] = RankSpeed(_mean(bws), _mean(fls))
    preds: dict[str, Any] = {}
    for b in batches:
        host = max(0.0, b / single_t[str(b)] - single_compute[str(b)])  # everything a step does but the linears
        for mode in ("single", "tp", "pp"):
            sp = speeds[mode]
            sp = RankSpeed(sp.mem_bandwidth, sp.flops, step_overhead_s=host)
            ranks = 1 if mode == "single" else len(probes)
            preds[f"{mode}/{b}"] = predict(shape, mode, ranks, b, sp, link if mode != "single" else None,
                                           bytes_per_param=bytes_per_param).to_dict()
    return preds, {k: {"mem_bandwidth": v.mem_bandwidth, "flops": v.flops} for k, v in speeds.items()}


@click.command("parallel")
@click.option("--ranks", type=int, default=2, show_default=True, help="Ranks of the TP and PP engines.")
@click.option("--batch", type=int, default=8, show_default=True, help="The larger batch (the other is 1).")
@click.option("--input-len", type=int, default=64, show_default=True,
              help="Prompt tokens of every request; also the prefill chunk of the compute probe.")
@click.option("--output-len", type=int, default=32, show_default=True, help="Generated tokens per request.")
@click.option("--reps", type=int, default=20, show_default=True, help="Repeats of every probe (median).")
@click.option("--short", is_flag=True, help="A quick pass: 8 tokens out, 5 repeats (for a smoke test).")
@engine_flags(defaults={"enable_prefix_caching": False})
def parallel(ranks: int, batch: int, input_len: int, output_len: int, reps: int, short: bool, **kw: Any) -> None:
    """Tensor and pipeline parallelism here: all-reduce and send/recv latency and bandwidth, per-rank compute of
    a decode step and a prefill chunk, decode tok/s of single process, TP and PP at batch 1 and --batch, weight
    bytes per rank; predicted (parallel/cost.py, fitted to the probes) against measured."""
    from brisk.bench.parallel import linear_bytes, run_decode, run_probes, time_linears
    from brisk.engine.settings import engine_kwargs
    from brisk.parallel.cost import Link, model_shape

    if short:
        output_len, reps = min(output_len, 8), min(reps, 5)
    if ranks < 2 or batch < 1 or input_len < 1 or output_len < 2 or reps < 1:
        raise ValueError(f"need --ranks >= 2, --batch >= 1, --input-len >= 1, --output-len >= 2, --reps >= 1; got "
                         f"{ranks}, {batch}, {input_len}, {output_len}, {reps}")
    if kw["tensor_parallel_size"] != 1 or kw["pipeline_parallel_size"] != 1:
        raise ValueError("bench parallel runs the single, TP and PP engines itself: leave --tensor-parallel-size "
                         "and --pipeline-parallel-size at 1 and give --ranks")
    set_threads(kw["num_threads"])
    threads = torch.get_num_threads()
    batches = (1, batch) if batch > 1 else (1,)
    rows = tuple(sorted({1, batch, input_len}))
    engine_kw = {k: v for k, v in engine_kwargs(kw).items() if v is not None}
    console = Console()

    # decode first: the single process's model is also the one whose linears are timed with every thread
    decode: dict[str, Any] = {}
    weights: dict[str, list[int]] = {}
    model_facts: dict[str, Any] = {}
    total = 3 * len(batches) * sum(batches) * output_len
    with report.progress_bar(f"decode: single, TP{ranks}, PP{ranks} at batch {', '.join(map(str, batches))}",
                             total) as advance:
        for mode in ("single", "tp", "pp"):
            sizes = {"tp": {"tensor_parallel_size": ranks}, "pp": {"pipeline_parallel_size": ranks}}.get(mode, {})
            llm = build_llm({**kw, **sizes})
            try:
                if mode == "single":
                    model_facts = describe_model(llm)
                    loaded = llm.engine.loaded
                    config = loaded.config
                for b in batches:
                    run_decode(llm, b, input_len, min(output_len, 4), seed=1)  # warm-up
                    res = run_decode(llm, b, input_len, output_len)
                    decode[f"{mode}/{b}"] = {"batch": b, "tok_s": res.tok_s, "decode_tokens": res.decode_tokens,
                                             "decode_s": res.decode_s}
                    advance(b * output_len)
                weights[mode] = llm.engine.rank_weight_bytes()
            finally:
                llm.engine.shutdown()
            del llm

    # the single process's linears with every thread (a fresh load: the engine may have converted its own)
    from brisk.engine.llm_engine import load_engine_model
    from brisk.engine.settings import build_engine_config

    single_loaded = load_engine_model(build_engine_config(**engine_kw))
    single_compute = time_linears(single_loaded.model, single_loaded.dtype, rows, reps)
    single_linear_bytes = linear_bytes(single_loaded.model)
    del single_loaded

    with report.progress_bar(f"probes: {ranks} ranks x {max(1, threads // ranks)} threads", 1) as advance:
        probes = run_probes({**engine_kw, "num_threads": max(1, threads // ranks)}, ranks, max(1, threads // ranks),
                            config.hidden_size, rows, reps)
        advance(1)

    shape = model_shape(config)
    link_fit = fit_link([{k: _mean([p["send_recv"][i][k] for p in probes[:2]]) for k in ("bytes", "seconds")}
                         for i in range(len(probes[0]["send_recv"]))])
    link = Link(link_fit["latency_s"], link_fit["bandwidth"])
    bytes_per_param = single_linear_bytes / shape.matmul_params
    single_t = {k.split("/")[1]: v["tok_s"] for k, v in decode.items() if k.startswith("single/")}
    preds, speeds = _predictions(shape, single_t, single_compute, probes, link, batches, input_len,
                                 bytes_per_param, single_linear_bytes)

    # ------------------------------------------------------------------ tables
    from brisk.parallel.cost import all_reduce_s, send_s

    t = Table(title=f"link: gloo, {ranks} ranks on this machine; fitted latency {link.latency_s * 1e6:.0f} us, "
                    f"bandwidth {link.bandwidth / 1e9:.2f} GB/s (send/recv)")
    for col in ("rows x hidden", "bytes", "all-reduce us", "model us", "all-reduce GB/s", "send/recv us",
                "model us ", "send/recv GB/s"):
        t.add_column(col, justify="right")
    rows_ = probes[0]["all_reduce"]
    ar = [_mean([p["all_reduce"][i]["seconds"] for p in probes]) for i in range(len(rows_))]
    sr = [_mean([p["send_recv"][i]["seconds"] for p in probes[:2]]) for i in range(len(rows_))]
    for i, r in enumerate(rows_):
        t.add_row(f"{r['rows']} x {config.hidden_size}", f"{r['bytes']:,}", f"{ar[i] * 1e6:.0f}",
                  f"{all_reduce_s(r['bytes'], ranks, link) * 1e6:.0f}", f"{r['bytes'] / ar[i] / 1e9:.2f}",
                  f"{sr[i] * 1e6:.0f}", f"{send_s(r['bytes'], link) * 1e6:.0f}", f"{r['bytes'] / sr[i] / 1e9:.2f}")
    console.print(t)

    t = Table(title=f"compute of the linears per rank ({max(1, threads // ranks)} threads each, all ranks at once; "
                    f"single process: {threads} threads), ms")
    t.add_column("cut")
    t.add_column("rank")
    t.add_column("layers", justify="right")
    t.add_column("linear MiB", justify="right")
    for n in rows:
        t.add_column(f"{n} row{'s' if n > 1 else ''}", justify="right")
    t.add_row("whole", "-", str(config.num_hidden_layers), f"{single_linear_bytes / 2**20:.1f}",
              *(f"{single_compute[str(n)] * 1e3:.2f}" for n in rows))
    for mode in ("tp", "pp"):
        for p in probes:
            c = p["compute"][mode]
            t.add_row(mode.upper() + str(ranks), str(p["rank"]), str(c["num_layers"]),
                      f"{c['linear_bytes'] / 2**20:.1f}", *(f"{c['seconds'][str(n)] * 1e3:.2f}" for n in rows))
    console.print(t)
    console.print("  raw rates per rank: read bandwidth " + ", ".join(f"{p['mem_bandwidth'] / 1e9:.1f}" for p in probes)
                  + " GB/s; float32 matmul " + ", ".join(f"{p['flops'] / 1e9:.0f}" for p in probes)
                  + " GFLOP/s. The linears' effective rates (cost model's BW, F): "
                  + "; ".join(f"{k} {v['mem_bandwidth'] / 1e9:.1f} GB/s, {v['flops'] / 1e9:.0f} GFLOP/s"
                              for k, v in speeds.items()))

    t = Table(title=f"decode tok/s: {model_facts['name']} ({model_facts['dtype']}), {input_len} prompt tokens -> "
                    f"{output_len}, same run; predicted = parallel/cost.py fitted here")
    for col in ("engine", "batch", "measured tok/s", "predicted tok/s", "error", "speed-up measured",
                "speed-up predicted"):
        t.add_column(col, justify="right")
    summary: dict[str, Any] = {}
    for mode in ("single", "tp", "pp"):
        for b in batches:
            key = f"{mode}/{b}"
            m, pr = decode[key]["tok_s"], preds[key]["tok_s"]
            base_m, base_p = decode[f"single/{b}"]["tok_s"], preds[f"single/{b}"]["tok_s"]
            summary[key] = {"measured_tok_s": m, "predicted_tok_s": pr, "error": pr / m - 1,
                            "speedup_measured": m / base_m, "speedup_predicted": pr / base_p}
            name = "single" if mode == "single" else f"{mode.upper()}{ranks}"
            t.add_row(name, str(b), f"{m:.1f}", f"{pr:.1f}", f"{(pr / m - 1) * 100:+.0f}%", f"{m / base_m:.2f}",
                      f"{pr / base_p:.2f}")
    console.print(t)
    full = weights["single"][0]
    for mode in ("tp", "pp"):
        console.print(f"weights per rank, {mode.upper()}{ranks}: "
                      + ", ".join(f"{w / 2**20:.1f} MiB ({w / full:.2f})" for w in weights[mode])
                      + f" of the whole model's {full / 2**20:.1f} MiB")

    json_path = kw.get("json_path")
    if json_path:
        report.write_json(json_path, "parallel", click.get_current_context().params, {
            "model": model_facts, "threads": threads, "ranks": ranks, "rows": list(rows),
            "link": {"fit": link_fit, "all_reduce": [{**r, "seconds": ar[i]} for i, r in enumerate(rows_)],
                     "send_recv": [{**r, "seconds": sr[i]} for i, r in enumerate(rows_)]},
            "compute": {"single": {"seconds": single_compute, "linear_bytes": single_linear_bytes,
                                   "threads": threads},
                        **{mode: [p["compute"][mode] for p in probes] for mode in ("tp", "pp")}},
            "rank_speeds": [{"rank": p["rank"], "mem_bandwidth": p["mem_bandwidth"], "flops": p["flops"]}
                            for p in probes],
            "effective_speeds": speeds, "decode": decode, "predicted": preds, "summary": summary,
            "weight_bytes_per_rank": weights})
