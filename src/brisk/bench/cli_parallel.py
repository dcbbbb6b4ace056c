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


def fit_link(points: list[dict[str, float]], ranks: int) -> dict[str, float]:
    """The Link whose ring all-reduce (parallel/cost.py all_reduce_s) matches the measured one at the smallest and
    the largest message: t = 2 (N-1) a + 2 (N-1)/N x bytes / b."""
    small, big = points[0], points[-1]
    steps = 2 * (ranks - 1)
    extra_s = big["seconds"] - small["seconds"]
    extra_b = (big["bytes"] - small["bytes"]) * steps / ranks
    bw = extra_b / extra_s if extra_s > 0 else big["bytes"] * steps / ranks / big["seconds"]
    return {"latency_s": small["seconds"] / steps, "bandwidth": bw}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _predictions(shape: Any, decode: dict[str, Any], single_compute: dict[str, float],
                 probes: list[dict[str, Any]], link: Any, batches: tuple[int, ...], prefill: int,
                 bytes_per_param: float, single_linear_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The cost model fitted here. Effective bandwidth and flop/s of the linears (decode rows, prefill rows) from
    the compute probes. Host seconds: the single process's = its measured step less its linears; a rank's = per
    layer, from the module-path process on a rank's threads (its step less the whole model's linears at those
    threads: the PP stages' probes added up), divided by the layers."""
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
    hosts: dict[str, Any] = {}
    for b in batches:
        host = max(0.0, b / decode[f"single/{b}"]["tok_s"] - single_compute[str(b)])
        rank_linears = sum(p["compute"]["pp"]["seconds"][str(b)] for p in probes)
        layer_host = max(0.0, b / decode[f"modules/{b}"]["tok_s"] - rank_linears) / shape.num_layers
        hosts[str(b)] = {"single_step_s": host, "rank_layer_s": layer_host}
        for mode in ("single", "tp", "pp"):
            sp = speeds[mode]
            sp = (RankSpeed(sp.mem_bandwidth, sp.flops, step_overhead_s=host) if mode == "single"
                  else RankSpeed(sp.mem_bandwidth, sp.flops, layer_overhead_s=layer_host))
            ranks = 1 if mode == "single" else len(probes)
            preds[f"{mode}/{b}"] = predict(shape, mode, ranks, b, sp, link if mode != "single" else None,
                                           bytes_per_param=bytes_per_param).to_dict()
    fitted = {k: {"mem_bandwidth": v.mem_bandwidth, "flops": v.flops} for k, v in speeds.items()}
    return preds, {**fitted, "host": hosts}


def _print_predictions(shape_name: str, ranks: int, batches: tuple[int, ...], link_gbps: float, link_us: float,
                       rank_gbps: float, rank_tflops: float, host_ms: float, bytes_per_param: float, context: int,
                       json_path: str | None) -> None:
    """--predict: the cost model alone, on the stated machine (no measurement)."""
    from brisk.parallel.cost import Link, RankSpeed, model_shape, prediction_rows

    shape = model_shape(shape_name)
    speed = RankSpeed(rank_gbps * 1e9, rank_tflops * 1e12, step_overhead_s=host_ms * 1e-3)
    link = Link(link_us * 1e-6, link_gbps * 1e9)
    rows = prediction_rows(shape, ranks, batches, speed, speed, link, bytes_per_param=bytes_per_param,
                           context=context)
    t = Table(title=f"predicted: {shape_name}, {bytes_per_param:g} bytes a weight, {ranks} ranks of {rank_gbps:g} GB/s "
                    f"and {rank_tflops:g} TFLOP/s each, link {link_gbps:g} GB/s + {link_us:g} us, host {host_ms:g} ms "
                    f"a step, context {context}")
    for col in ("engine", "batch", "GB read/rank", "compute ms", "comm ms", "step ms", "tok/s", "speed-up"):
        t.add_column(col, justify="right")
    for r in rows:
        name = "1 rank" if r["mode"] == "single" else f"{str(r['mode']).upper()}{ranks}"
        t.add_row(name, str(r["batch"]), f"{float(r['read_bytes_per_rank']) / 1e9:.2f}",
                  f"{float(r['compute_s']) * 1e3:.2f}", f"{float(r['comm_s']) * 1e3:.2f}",
                  f"{float(r['step_s']) * 1e3:.2f}", f"{float(r['tok_s']):.1f}", f"{float(r['speedup']):.2f}")
    Console().print(t)
    if json_path:
        report.write_json(json_path, "parallel-predict", click.get_current_context().params, {"predicted": rows})


@click.command("parallel")
@click.option("--ranks", type=int, default=2, show_default=True, help="Ranks of the TP and PP engines.")
@click.option("--batch", type=int, default=8, show_default=True, help="The larger batch (the other is 1).")
@click.option("--input-len", type=int, default=64, show_default=True,
              help="Prompt tokens of every request; also the prefill chunk of the compute probe.")
@click.option("--output-len", type=int, default=32, show_default=True, help="Generated tokens per request.")
@click.option("--reps", type=int, default=20, show_default=True, help="Repeats of every probe (median).")
@click.option("--runs", type=int, default=3, show_default=True,
              help="Decode runs of every engine and batch; the fastest is reported.")
@click.option("--short", is_flag=True, help="A quick pass: 8 tokens out, 5 repeats, 1 run (for a smoke test).")
@click.option("--predict", "predict_shape", default=None,
              help="Measure nothing: print the cost model's predictions for this shape (a name in model/dummy.py or "
                   "an HF config.json) on --ranks ranks of the machine the options below describe.")
@click.option("--link-gbps", type=float, default=25.0, show_default=True, help="--predict: link bandwidth, GB/s.")
@click.option("--link-latency-us", type=float, default=10.0, show_default=True,
              help="--predict: link latency, microseconds.")
@click.option("--rank-gbps", type=float, default=200.0, show_default=True,
              help="--predict: memory bandwidth one rank reaches, GB/s.")
@click.option("--rank-tflops", type=float, default=2.0, show_default=True,
              help="--predict: matmul TFLOP/s one rank reaches.")
@click.option("--host-ms", type=float, default=1.0, show_default=True,
              help="--predict: host milliseconds a step (scheduling, sampling, Python).")
@click.option("--bytes-per-param", type=float, default=2.0, show_default=True,
              help="--predict: bytes a weight (2: bf16; about 0.56: 4-bit, group-64 scales).")
@click.option("--context", type=int, default=1024, show_default=True,
              help="--predict: positions each request attends to (its K/V is read every step).")
@engine_flags(defaults={"enable_prefix_caching": False})
def parallel(ranks: int, batch: int, input_len: int, output_len: int, reps: int, runs: int, short: bool,
             predict_shape: str | None, link_gbps: float, link_latency_us: float, rank_gbps: float,
             rank_tflops: float, host_ms: float, bytes_per_param: float, context: int, **kw: Any) -> None:
    """Tensor and pipeline parallelism here: all-reduce and send/recv latency and bandwidth, per-rank compute of
    a decode step and a prefill chunk, decode tok/s of single process, TP and PP at batch 1 and --batch, weight
    bytes per rank; predicted (parallel/cost.py, fitted to the probes) against measured."""
    from brisk.bench.parallel import linear_bytes, run_decode, run_probes, time_linears
    from brisk.engine.settings import engine_kwargs
    from brisk.parallel.cost import Link, model_shape

    if predict_shape is not None:
        if ranks < 2 or batch < 1 or context < 0:
            raise ValueError(f"need --ranks >= 2, --batch >= 1 and --context >= 0; got {ranks}, {batch}, {context}")
        _print_predictions(predict_shape, ranks, (1, batch) if batch > 1 else (1,), link_gbps, link_latency_us,
                           rank_gbps, rank_tflops, host_ms, bytes_per_param, context, kw.get("json_path"))
        return
    if short:
        output_len, reps, runs = min(output_len, 8), min(reps, 5), 1
    if ranks < 2 or batch < 1 or input_len < 1 or output_len < 2 or reps < 1 or runs < 1:
        raise ValueError(f"need --ranks >= 2, --batch >= 1, --input-len >= 1, --output-len >= 2, --reps >= 1, "
                         f"--runs >= 1; got {ranks}, {batch}, {input_len}, {output_len}, {reps}, {runs}")
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
    rank_threads = max(1, threads // ranks)
    total = 4 * runs * sum(batches) * output_len
    with report.progress_bar(f"decode: single, TP{ranks}, PP{ranks}, modules at batch {', '.join(map(str, batches))}",
                             total) as advance:
        for mode in ("single", "tp", "pp", "modules"):
            # modules: the calibration of the cost model's host time, one process on the path and threads a rank
            # runs (the module path, threads // ranks), off the single process's fast path
            sizes = {"tp": {"tensor_parallel_size": ranks}, "pp": {"pipeline_parallel_size": ranks},
                     "modules": {"execution": "modules", "num_threads": rank_threads}}.get(mode, {})
            torch.set_num_threads(threads)
            llm = build_llm({**kw, **sizes})
            try:
                if mode == "single":
                    model_facts = describe_model(llm)
                    loaded = llm.engine.loaded
                    config = loaded.config
                for b in batches:
                    run_decode(llm, b, input_len, min(output_len, 4), seed=1)  # warm-up
                    # best of --runs: another process's load only ever makes a run slower
                    res = [run_decode(llm, b, input_len, output_len, seed=2 + r) for r in range(runs)]
                    best = max(res, key=lambda d: d.tok_s)
                    decode[f"{mode}/{b}"] = {"batch": b, "tok_s": best.tok_s, "decode_tokens": best.decode_tokens,
                                             "decode_s": best.decode_s, "tok_s_all": [d.tok_s for d in res]}
                    advance(runs * b * output_len)
                weights[mode] = llm.engine.rank_weight_bytes()
            finally:
                llm.engine.shutdown()
            del llm
    torch.set_num_threads(threads)

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
    link_fit = fit_link([{k: _mean([p["all_reduce"][i][k] for p in probes]) for k in ("bytes", "seconds")}
                         for i in range(len(probes[0]["all_reduce"]))], ranks)
    link = Link(link_fit["latency_s"], link_fit["bandwidth"])
    bytes_per_param = single_linear_bytes / shape.matmul_params
    preds, speeds = _predictions(shape, decode, single_compute, probes, link, batches, input_len,
                                 bytes_per_param, single_linear_bytes)

    # ------------------------------------------------------------------ tables
    from brisk.parallel.cost import all_reduce_s, send_s

    t = Table(title=f"link: gloo, {ranks} ranks on this machine; fitted latency {link.latency_s * 1e6:.0f} us, "
                    f"bandwidth {link.bandwidth / 1e9:.2f} GB/s (fitted to the all-reduce; means of --reps)")
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
                              for k, v in speeds.items() if k != "host")
                  + "; host a step, single process: " + ", ".join(
                      f"{h['single_step_s'] * 1e3:.1f} ms (batch {b})" for b, h in speeds["host"].items())
                  + f"; a rank, per layer ({rank_threads} thread(s), module path): " + ", ".join(
                      f"{h['rank_layer_s'] * 1e3:.2f} ms (batch {b})" for b, h in speeds["host"].items()))

    t = Table(title=f"decode tok/s: {model_facts['name']} ({model_facts['dtype']}), {input_len} prompt tokens -> "
                    f"{output_len}, same run; predicted = parallel/cost.py fitted here")
    for col in ("engine", "batch", "measured tok/s", "predicted tok/s", "error", "speed-up measured",
                "speed-up predicted"):
        t.add_column(col, justify="right")
    summary: dict[str, Any] = {}
    for mode in ("single", "modules", "tp", "pp"):
        for b in batches:
            key = f"{mode}/{b}"
            if mode == "modules":
                t.add_row(f"modules, {rank_threads} thr", str(b), f"{decode[key]['tok_s']:.1f}", "(fit)", "",
                          f"{decode[key]['tok_s'] / decode[f'single/{b}']['tok_s']:.2f}", "")
                continue
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
