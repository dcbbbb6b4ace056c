"""`brisk bench parallel`: the link, per-rank compute and decode tok/s of single process, TP and PP, against the cost
model (parallel/cost.py) fitted to this machine's measurements (bench/parallel.py; docs/parallel.md)."""

from __future__ import annotations

from typing import Any

import click
import torch
from rich.console import Console
from rich.table import Table

from brisk.bench.options import build_llm, describe_model, engine_flags, set_threads
from brisk.console import progress_bar, write_json


def fit_link(points: list[dict[str, float]], steps: float = 1.0, share: float = 1.0) -> dict[str, float]:
    """The (latency, bandwidth) of a message costing t = steps x a + share x bytes / b, fitted by least squares to
    the measured (bytes, seconds) points (bandwidth held positive: at small messages the noise of a loaded link can
    exceed the bytes' part). A ring all-reduce on N ranks: steps = 2 (N-1), share = 2 (N-1)/N; a send: 1 and 1."""
    xs = [p["bytes"] * share for p in points]
    ys = [p["seconds"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    if slope <= 0:  # no measurable bytes' part: the whole time is latency, the bandwidth that of the largest
        big = max(points, key=lambda p: p["bytes"])
        return {"latency_s": my / steps, "bandwidth": big["bytes"] * share / big["seconds"]}
    return {"latency_s": max(0.0, my - slope * mx) / steps, "bandwidth": 1.0 / slope}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _line(points: dict[int, float]) -> tuple[float, float]:
    """(fixed, per token) of a cost measured at token counts {n: seconds}: the line through the smallest and the
    largest, each part clipped at 0."""
    lo, hi = min(points), max(points)
    per = max(0.0, (points[hi] - points[lo]) / (hi - lo)) if hi > lo else 0.0
    return max(0.0, points[lo] - per * lo), per


def _predictions(shape: Any, decode: dict[str, Any], single_compute: dict[str, float],
                 modules_compute: dict[str, float], probes: list[dict[str, Any]], link: Any, p2p: Any,
                 batches: tuple[int, ...], bytes_per_param: float, single_linear_bytes: int
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The cost model fitted here. Each rank's bandwidth = its linears' bytes over their decode-row seconds; its
    flop/s = the linears' flops at the largest decode batch over their seconds (a skinny matmul's rate, not a
    prefill's). Host seconds, each a fixed part plus a part per token (the line through batch 1 and --batch):
    the single process's a step = its measured step less its linears; a rank's from the module-path process on a
    rank's threads: a step = its step less its forward (scheduling, sampling: the driver's), a layer = its forward
    less its linears (timed in that process, at those threads), over the layers."""
    from brisk.parallel.cost import RankSpeed, predict

    top = max(batches)
    flops_top = 2 * shape.matmul_params * top
    single_speed = RankSpeed(single_linear_bytes / single_compute["1"], flops_top / single_compute[str(top)])
    speeds: dict[str, Any] = {"single": single_speed}
    for mode in ("tp", "pp"):
        # the ranks' mean: each rank's linear bytes over its decode seconds; its flops over its batch seconds
        bws = [p["compute"][mode]["linear_bytes"] / p["compute"][mode]["seconds"]["1"] for p in probes]
        share = [p["compute"][mode]["linear_bytes"] / single_linear_bytes for p in probes]
        fls = [flops_top * sh / p["compute"][mode]["seconds"][str(top)] for sh, p in zip(share, probes, strict=True)]
        speeds[mode] = RankSpeed(_mean(bws), _mean(fls))
    single_host, rank_step, rank_layer = {}, {}, {}
    for b in batches:
        single_host[b] = max(0.0, b / decode[f"single/{b}"]["tok_s"] - single_compute[str(b)])
        mod = decode[f"modules/{b}"]
        step = b / mod["tok_s"]
        forward = mod["forward_s"] / mod["steps"] if mod["steps"] else step
        rank_step[b] = max(0.0, step - forward)
        rank_layer[b] = max(0.0, forward - modules_compute[str(b)]) / shape.num_layers
    s0, s1 = _line(single_host)
    r0, r1 = _line(rank_step)
    l0, l1 = _line(rank_layer)
    hosts = {str(b): {"single_step_s": single_host[b], "rank_step_s": rank_step[b], "rank_layer_s": rank_layer[b]}
             for b in batches}
    preds: dict[str, Any] = {}
    for b in batches:
        for mode in ("single", "tp", "pp"):
            sp = speeds[mode]
            sp = (RankSpeed(sp.mem_bandwidth, sp.flops, step_overhead_s=s0, step_token_s=s1) if mode == "single"
                  else RankSpeed(sp.mem_bandwidth, sp.flops, step_overhead_s=r0, step_token_s=r1,
                                 layer_overhead_s=l0, layer_token_s=l1))
            ranks = 1 if mode == "single" else len(probes)
            preds[f"{mode}/{b}"] = predict(shape, mode, ranks, b, sp, link if mode != "single" else None,
                                           bytes_per_param=bytes_per_param, p2p=p2p).to_dict()
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
        write_json(json_path, "parallel-predict", click.get_current_context().params, {"predicted": rows})


@click.command("parallel")
@click.option("--ranks", type=int, default=2, show_default=True, help="Ranks of the TP and PP engines.")
@click.option("--batch", type=int, default=8, show_default=True, help="The larger batch (the other is 1).")
@click.option("--input-len", type=int, default=64, show_default=True,
              help="Prompt tokens of every request; also the prefill chunk of the compute probe.")
@click.option("--output-len", type=int, default=32, show_default=True, help="Generated tokens per request.")
@click.option("--reps", type=int, default=20, show_default=True,
              help="Repeats of every compute probe (median); the link probes send 25 x as many messages (mean).")
@click.option("--runs", type=int, default=5, show_default=True,
              help="Decode runs of every engine and batch; the median is reported (and every run in the JSON).")
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

    from brisk.engine.llm_engine import load_engine_model
    from brisk.engine.settings import build_engine_config

    # decode first; the single and module-path processes' linears are timed right after their own runs (a fresh
    # load: the engine may have converted its own), so that the host time subtracted from their steps comes from
    # the same minute of a machine whose speed drifts
    decode: dict[str, Any] = {}
    linears: dict[str, dict[str, float]] = {}
    single_linear_bytes = 0
    weights: dict[str, list[int]] = {}
    model_facts: dict[str, Any] = {}
    rank_threads = max(1, threads // ranks)
    total = 4 * runs * sum(batches) * output_len
    with progress_bar(f"decode: single, TP{ranks}, PP{ranks}, modules at batch {', '.join(map(str, batches))}",
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
                    # the median of --runs: a shared VM's runs spread both ways (a neighbour's load, a stolen
                    # core), and the probes it is compared with are means and medians too
                    res = sorted((run_decode(llm, b, input_len, output_len, seed=2 + r) for r in range(runs)),
                                 key=lambda d: d.tok_s)
                    best = res[len(res) // 2]
                    decode[f"{mode}/{b}"] = {"batch": b, "tok_s": best.tok_s, "decode_tokens": best.decode_tokens,
                                             "decode_s": best.decode_s, "steps": best.steps,
                                             "forward_s": best.forward_s, "tok_s_all": [d.tok_s for d in res]}  # sorted
                    advance(runs * b * output_len)
                weights[mode] = llm.engine.rank_weight_bytes()
                if mode in ("single", "modules"):
                    fresh = load_engine_model(build_engine_config(**{**engine_kw, **sizes}))
                    linears[mode] = time_linears(fresh.model, fresh.dtype, rows, reps)
                    single_linear_bytes = single_linear_bytes or linear_bytes(fresh.model)
                    del fresh
            finally:
                llm.engine.shutdown()
            del llm
    torch.set_num_threads(threads)
    single_compute = linears["single"]

    with progress_bar(f"probes: {ranks} ranks x {max(1, threads // ranks)} threads", 1) as advance:
        probes = run_probes({**engine_kw, "num_threads": max(1, threads // ranks)}, ranks, max(1, threads // ranks),
                            config.hidden_size, config.vocab_size, rows, reps, link_reps=25 * reps)
        advance(1)

    shape = model_shape(config)
    def points(op: str, among: list[dict[str, Any]]) -> list[dict[str, float]]:  # the ranks' mean a message
        return [{k: _mean([p[op][i][k] for p in among]) for k in ("bytes", "seconds")}
                for i in range(len(among[0][op]))]

    # collectives: fitted to the all-reduces, their bandwidth no higher than the sends' (the same sockets)
    p2p_fit = fit_link(points("send_recv", probes[1:2]))
    ar_fit = fit_link(points("all_reduce", probes), 2 * (ranks - 1), 2 * (ranks - 1) / ranks)
    link_fit = {"latency_s": ar_fit["latency_s"], "bandwidth": min(ar_fit["bandwidth"], p2p_fit["bandwidth"])}
    link, p2p = Link(link_fit["latency_s"], link_fit["bandwidth"]), Link(p2p_fit["latency_s"], p2p_fit["bandwidth"])
    bytes_per_param = single_linear_bytes / shape.matmul_params
    preds, speeds = _predictions(shape, decode, single_compute, linears["modules"], probes, link, p2p, batches,
                                 bytes_per_param, single_linear_bytes)

    # ------------------------------------------------------------------ tables
    from brisk.parallel.cost import all_reduce_s, gather_s, send_s

    t = Table(title=f"link: gloo, {ranks} ranks on this machine, each message after a small matmul, means of "
                    f"{25 * reps}; collectives: latency {link.latency_s * 1e6:.0f} us a ring step, "
                    f"{link.bandwidth / 1e9:.2f} GB/s; sends: {p2p.latency_s * 1e6:.0f} us + {p2p.bandwidth / 1e9:.2f} "
                    f"GB/s (least-squares fits)")
    for col in ("message", "shape", "bytes", "measured us", "model us", "GB/s"):
        t.add_column(col, justify="right")
    measured: dict[str, list[dict[str, Any]]] = {}
    for op, among in (("all_reduce", probes), ("gather", probes), ("send_recv", probes[1:2])):
        measured[op] = [{**r, "seconds": pt["seconds"]} for r, pt in zip(probes[0][op], points(op, among), strict=True)]
    vocab_share = config.vocab_size // ranks
    for op, rs in measured.items():
        for r in rs:
            if op == "all_reduce":
                shape_s, model_s = f"{r['rows']} x {config.hidden_size}", all_reduce_s(r["bytes"], ranks, link)
            elif op == "gather":
                shape_s, model_s = f"{r['rows']} x {vocab_share}", gather_s(r["bytes"], ranks, link)
            else:
                hand_off = r["bytes"] == 2 * r["rows"] * config.hidden_size * 4
                shape_s = (f"2 x {r['rows']} x {config.hidden_size}" if hand_off
                           else f"{r['rows']} x {config.vocab_size}")
                model_s = send_s(r["bytes"], p2p)
            t.add_row(op.replace("_", " ").replace("send recv", "send"), shape_s, f"{r['bytes']:,}",
                      f"{r['seconds'] * 1e6:.0f}", f"{model_s * 1e6:.0f}", f"{r['bytes'] / r['seconds'] / 1e9:.2f}")
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
    t.add_row(f"whole, {rank_threads} thr", "-", str(config.num_hidden_layers), f"{single_linear_bytes / 2**20:.1f}",
              *(f"{linears['modules'][str(n)] * 1e3:.2f}" for n in rows))
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
                  + f"; a rank ({rank_threads} thread(s), module path), the driver's a step and a layer's: "
                  + ", ".join(f"{h['rank_step_s'] * 1e3:.2f} and {h['rank_layer_s'] * 1e3:.2f} ms (batch {b})"
                              for b, h in speeds["host"].items()))

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
        write_json(json_path, "parallel", click.get_current_context().params, {
            "model": model_facts, "threads": threads, "ranks": ranks, "rows": list(rows),
            "link": {"collectives": link_fit, "p2p": p2p_fit, **measured},
            "compute": {"single": {"seconds": single_compute, "linear_bytes": single_linear_bytes,
                                   "threads": threads},
                        "modules": {"seconds": linears["modules"], "threads": rank_threads},
                        **{mode: [p["compute"][mode] for p in probes] for mode in ("tp", "pp")}},
            "rank_speeds": [{"rank": p["rank"], "mem_bandwidth": p["mem_bandwidth"], "flops": p["flops"]}
                            for p in probes],
            "effective_speeds": speeds, "decode": decode, "predicted": preds, "summary": summary,
            "weight_bytes_per_rank": weights})
