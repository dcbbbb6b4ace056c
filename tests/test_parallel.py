"""Tensor parallelism: sharded linears equal the full ones; a 2-process gloo engine gives the single engine's tokens."""

from __future__ import annotations

import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.ops.layers import FastLinear, QuantLinear
from brisk.ops.qlinear import prepack
from brisk.parallel.shard import cut_linear, head_shard, split_evenly
from brisk.quant.primitives import pack


def _float_linear(n: int, k: int) -> FastLinear:
    torch.manual_seed(0)
    lin = FastLinear(k, n, bias=False)
    return lin


def _quant_linear(n: int, k: int, bits: int, group: int) -> QuantLinear:
    from brisk.quant.config import LayerQuant

    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.01 + 0.001
    zeros = torch.randint(0, 2**bits, (n, k // group), generator=g).float()
    pw = prepack(pack(q, bits), scales, zeros, bits, group, k)
    return QuantLinear(pw, None, LayerQuant(bits=bits, group_size=group))


def _min_form_linear(n: int, k: int, group: int) -> QuantLinear:
    """4-bit codes with float minimums (w = scale * q + min), the form GGUF's Q4_1 and K-quants load as."""
    from brisk.ops.qlinear import _finish
    from brisk.quant.config import LayerQuant

    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 0.001).half()
    mins = (torch.rand(n, k // group, generator=g) * -0.05).half()
    return QuantLinear(_finish(q, 4, group, k, pack(q, 4), scales, mins, None), None, LayerQuant(bits=4,
                                                                                              group_size=group))


@pytest.mark.parametrize("kind", ["float", "int4", "int8", "int4-min"])
def test_row_and_column_shards_equal_full_linear(kind):
    n, k = 64, 128
    if kind == "float":
        lin = _float_linear(n, k)
    elif kind == "int4-min":
        lin = _min_form_linear(n, k, 32)
    else:
        lin = _quant_linear(n, k, 4 if kind == "int4" else 8, 32)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    full = lin(x)
    # column-parallel: each rank's rows, concatenated
    cols = [cut_linear(lin, rows=[r])(x) for r in split_evenly(n, 2)]
    torch.testing.assert_close(torch.cat(cols, dim=-1), full, rtol=1e-5, atol=1e-5)
    # row-parallel: each rank's whole groups of input columns, summed (what the all-reduce does)
    parts = [cut_linear(lin, cols=c)(x[:, c[0]:c[1]]) for c in split_evenly(k, 2, 32)]
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-4, atol=1e-4)


def test_head_shards():
    a, b = head_shard(9, 3, 0, 2), head_shard(9, 3, 1, 2)
    assert (a.q0, a.q1, a.kv0, a.kv1, b.q0, b.q1, b.kv0, b.kv1) == (0, 6, 0, 2, 6, 9, 2, 3)
    # fewer KV heads than ranks: each KV head replicated, its query heads split
    r = [head_shard(8, 2, i, 4) for i in range(4)]
    assert [(s.q0, s.q1, s.kv0) for s in r] == [(0, 2, 0), (2, 4, 0), (4, 6, 1), (6, 8, 1)]


def test_tensor_parallel_engine_equals_single(tmp_path):
    path = tmp_path / "m"
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=384)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 17, 33, 2)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    single = LLM(str(path), max_model_len=256)
    ref = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    [full] = single.engine.rank_weight_bytes()
    llm = LLM(str(path), max_model_len=256, tensor_parallel_size=2, distributed_timeout=30)
    try:
        runner = llm.engine.runner
        procs = list(runner.state.procs)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        per_rank = llm.engine.rank_weight_bytes()
    finally:
        llm.engine.shutdown()
    assert out == ref
    # each rank holds about half the single engine's weights (the norms are whole on both)
    assert runner.full_weight_bytes == full
    assert len(per_rank) == 2 and all(0.45 < b / full < 0.55 for b in per_rank), (per_rank, full)
    assert all(not p.is_alive() for p in procs)  # no leaked worker


def test_pipeline_parallel_engine_equals_single(tmp_path):
    """Two stages, requests of several lengths arriving while others decode: the micro-batches take turns, and
    greedy tokens equal the single engine's."""
    path = tmp_path / "m"
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=384)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 17, 33, 2, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(str(path), max_model_len=256).generate(prompts, params)]
    llm = LLM(str(path), max_model_len=256, pipeline_parallel_size=2, distributed_timeout=30)
    try:
        procs = list(llm.engine.runner.state.procs)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.runner.max_in_flight == 2  # both stages had a micro-batch
    finally:
        llm.engine.shutdown()
    assert out == ref
    assert all(not p.is_alive() for p in procs)


def test_tensor_times_pipeline_engine_equals_single(tmp_path):
    """Two stages of two tensor-parallel ranks each (4 processes): every stage's ranks shard its layers, hidden
    states go from tensor rank r of one stage to tensor rank r of the next, the last stage's tensor rank 0 sends
    the gathered logits to the driver; greedy tokens equal the single engine's, each rank holds about a quarter."""
    path = tmp_path / "m"
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=384)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 17, 33, 2, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    single = LLM(str(path), max_model_len=256)
    ref = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    [full] = single.engine.rank_weight_bytes()
    llm = LLM(str(path), max_model_len=256, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_timeout=60)
    try:
        state = llm.engine.runner.state
        procs = list(state.procs)
        assert (state.tp_rank, state.pp_rank, state.tp_group.size) == (0, 0, 2)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.runner.max_in_flight == 2
        per_rank = llm.engine.rank_weight_bytes()
    finally:
        llm.engine.shutdown()
    assert out == ref
    assert len(per_rank) == 4 and sum(per_rank) < 1.1 * full and all(b < 0.4 * full for b in per_rank), per_rank
    assert len(procs) == 3 and all(not p.is_alive() for p in procs)


def test_a_killed_worker_fails_the_engine_clearly_and_frees_it(tmp_path):
    """A worker killed between steps: the next step raises ParallelError naming the worker (not a hang), the
    engine's other workers are stopped, the process group is freed, and later calls say the engine is shut down."""
    import torch.distributed as dist

    from brisk.parallel.comm import ParallelError

    path = tmp_path / "m"
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=384)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(path), max_model_len=128, tensor_parallel_size=2, distributed_timeout=20)
    try:
        procs = list(llm.engine.runner.state.procs)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
        procs[0].kill()
        procs[0].join(timeout=10)
        with pytest.raises(ParallelError, match="worker failed") as failure:
            llm.generate([[5, 6, 7, 8]], params)
        assert "exited with code" in str(failure.value) or "timeout" in str(failure.value)
        assert not dist.is_initialized()
        assert all(not p.is_alive() for p in procs)
        with pytest.raises(ParallelError, match="shut down"):
            llm.generate([[5, 6]], params)
    finally:
        llm.engine.shutdown()


def _worker_pids(timeout: float = 60.0) -> list[int]:
    """The pids of this process's parallel workers (`python -m brisk.parallel.worker`), once there is one."""
    import os
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p.pid for p in psutil.Process(os.getpid()).children()
                if "brisk.parallel.worker" in " ".join(p.cmdline())]
        if pids:
            return pids
        time.sleep(0.02)
    raise AssertionError("no worker process appeared")


def _start_in_background(path, **settings):
    """LLM(...) on a thread; returns (thread, result dict with 'llm' or 'error', start time)."""
    import threading
    import time

    result: dict = {}

    def build() -> None:
        try:
            result["llm"] = LLM(str(path), max_model_len=128, **settings)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            result["error"] = e
            result["seconds"] = time.monotonic() - t0

    t0 = time.monotonic()
    thread = threading.Thread(target=build)
    thread.start()
    return thread, result


def test_a_worker_killed_at_start_up_is_reported_at_once(tmp_path):
    """A worker that dies while the engine starts (here: kill -9 as it loads, as the out-of-memory killer would):
    the driver reports it within seconds, with the rank, the step and the signal, not after the rendezvous'
    timeout; nothing is left running and the process group is not left half made."""
    import os
    import signal

    import torch.distributed as dist

    from brisk.parallel.comm import ParallelError

    path = tmp_path / "m"
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=384)
    thread, result = _start_in_background(path, tensor_parallel_size=2, distributed_timeout=120)
    [pid] = _worker_pids()
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=100)
    assert not thread.is_alive()
    error = result.get("error")
    assert isinstance(error, ParallelError), result
    assert "rank 1 failed while" in str(error) and "SIGKILL" in str(error), str(error)
    assert result["seconds"] < 30, result["seconds"]  # reported from the process's exit, not the 120 s timeout
    assert not dist.is_initialized()


def test_a_worker_stuck_at_start_up_is_named_with_its_step(tmp_path, monkeypatch):
    """A worker that makes no progress (stopped with SIGSTOP before it loads): past the start-up bound the driver
    names the rank and the step it is stuck in, and stops it."""
    import os
    import signal

    from brisk.parallel import launch
    from brisk.parallel.comm import ParallelError

    monkeypatch.setattr(launch, "LOAD_SECONDS", 3.0)
    path = tmp_path / "m"
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=384)
    thread, result = _start_in_background(path, tensor_parallel_size=2, distributed_timeout=3)
    [pid] = _worker_pids()
    os.kill(pid, signal.SIGSTOP)
    thread.join(timeout=100)
    error = result.get("error")
    assert isinstance(error, ParallelError), result
    assert "rank 1 is still" in str(error) and "within 3 s" in str(error), str(error)
    import psutil

    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


_STDIN_SCRIPT = """
import json, sys
from brisk import LLM, SamplingParams
sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
prompts = ["Once upon a time", "The capital of France is", "def add(a, b):", "Emma Woodhouse was"]
out = {}
for name, parallel in [("single", {}), ("tp2", {"tensor_parallel_size": 2}), ("pp2", {"pipeline_parallel_size": 2}),
                       ("tp2xpp2", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2})]:
    llm = LLM(max_model_len=256, kv_cache_memory="64MiB", distributed_timeout=120, **parallel)
    try:
        out[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
    finally:
        llm.engine.shutdown()
from brisk.ops import kernels
print("RESULT " + json.dumps({"tier": kernels.kernel_tier().name, "tokens": out}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["native", "avx2vnni", "avx2"])
def test_default_model_parallel_from_stdin_on_every_tier(tier):
    """The default model in its own precision (the file's Q4_1 codes, as `brisk generate` runs it), one process,
    TP=2, PP=2 and TP=2 x PP=2, from a program read on standard input (`python - < script`: the workers must not
    re-run the user's main module), with this CPU's kernels and with the lower tiers forced: greedy tokens equal."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("BRISK_KERNEL_ISA", "PYTEST_ADDOPTS")}
    if tier != "native":
        env["BRISK_KERNEL_ISA"] = tier
    done = subprocess.run([sys.executable, "-"], input=_STDIN_SCRIPT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    [line] = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    if tier != "native":
        from brisk.ops import isa

        assert got["tier"] == isa.choose_tier(isa.cpu_flags(), tier).name
    tokens = got["tokens"]
    for name in ("tp2", "pp2", "tp2xpp2"):
        assert tokens[name] == tokens["single"], name


def test_server_answers_503_and_exits_nonzero_when_a_worker_dies(tmp_path):
    """`brisk serve --tensor-parallel-size 2` with its worker killed: the next request gets a 503 (engine_dead)
    in OpenAI's error shape, and the server stops with exit code 1 (for a supervisor to restart it), its
    remaining processes gone."""
    import time

    import httpx
    import psutil

    from brisk.serve.process import ServerProcess

    path = tmp_path / "m"
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=384)
    server = ServerProcess(["--model", str(path), "--served-model-name", "tiny", "--max-model-len", "128",
                            "--kv-cache-memory", "8MiB", "--tensor-parallel-size", "2", "--distributed-timeout", "20"],
                           startup_timeout_s=180)
    server.start()
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        workers = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                   if "brisk.parallel.worker" in " ".join(p.cmdline())]
        assert len(workers) == 1, [p.cmdline() for p in workers]
        workers[0].kill()  # not our child: it stays a zombie until the server reaps it, so wait for that state
        for _ in range(100):
            if not workers[0].is_running() or workers[0].status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.1)
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_dead" and "worker" in r.json()["error"]["message"]
        assert server.proc.wait(timeout=60) == 1, server.log_tail()
        assert "the engine is down" in server.log()
    finally:
        server.stop()


# ---------------------------------------------------------------------------- the default model (slow)
_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
            "The three laws of thermodynamics are", "import numpy as np\n", "My favourite recipe for bread:",
            "Q: What is 17 times 23?\nA:", "The history of the Roman Empire begins"]


def _default_model_outputs(**parallel: int) -> tuple[list[list[int]], list[dict[int, float]]]:
    """Greedy tokens (8 prompts x 64) and the logprobs of each prompt's first token (the prefill's logits, less
    their logsumexp) on the default model in float32, single-process or parallel."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=8)
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory="64MiB", distributed_timeout=120, **parallel)
    try:
        outs = llm.generate(_PROMPTS, params)
    finally:
        llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], [dict(o.outputs[0].logprobs[0]) for o in outs]


def _assert_same(ref: tuple, got: tuple) -> None:
    assert got[0] == ref[0]
    for want, have in zip(ref[1], got[1], strict=True):
        assert set(have) == set(want)
        assert max(abs(have[t] - want[t]) for t in want) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                      {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2", "tp2xpp2"])
def test_default_model_parallel_equals_single(parallel):
    _assert_same(_default_model_outputs(), _default_model_outputs(**parallel))


# ---------------------------------------------------------------------------- data-parallel replicas
def test_replica_args_and_prefix_policy():
    from brisk.serve.router import CHUNK, RouterPolicy, replica_args

    argv = ["--model", "m", "--data-parallel-size", "2", "--port=9000", "--host", "0.0.0.0", "--router-policy",
            "prefix", "--threads", "1"]
    assert replica_args(argv, 2) == ["--model", "m", "--threads", "1"]
    router = RouterPolicy(2, "prefix")
    a, b = "A" * (4 * CHUNK), "B" * (4 * CHUNK)
    first = router.choose(a + "question one")
    router.in_flight[first[0]] += 1  # still running: a new prompt goes to the other replica
    other = router.choose(b + "question one")
    assert other == (1 - first[0], "load")
    assert router.choose(a + "question two") == (first[0], "prefix")  # its prefix, though that replica is busier
    assert router.choose(b + "question two") == (other[0], "prefix")
    with pytest.raises(ValueError, match="router policy"):
        RouterPolicy(2, "random")


def _shared_prompt_hit_rate(path, policy: str) -> tuple[float, list[int]]:
    """8 system prompts x 3 questions, in shuffled order, through `brisk serve --data-parallel-size 2`: the
    prefix-cache hit rate summed over the replicas (tokens), and how many requests each replica got."""
    import random

    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from brisk.serve.process import ServerProcess

    rng = random.Random(0)
    words = "apple river stone cloud lamp forest engine paper violet copper harbour window".split()
    systems = [f"System {i}: " + " ".join(rng.choice(words) for _ in range(40)) for i in range(8)]
    prompts = [f"{s}\nQuestion {j}: {rng.choice(words)}?" for s in systems for j in range(3)]
    rng.shuffle(prompts)
    server = ServerProcess(["--model", str(path), "--served-model-name", "tiny", "--max-model-len", "512",
                            "--kv-cache-memory", "8MiB", "--data-parallel-size", "2", "--router-policy", policy],
                           startup_timeout_s=240)
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
        for p in prompts:
            out = client.completions.create(model="tiny", prompt=p, max_tokens=1, temperature=0)
            assert out.choices[0].text is not None
        stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=3, temperature=0,
                                           stream=True)
        chunks = list(stream)  # a stream through the router stays a stream (tokens may share a chunk)
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
    values: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "replica" in s.labels:
                key = (s.name, s.labels["replica"])
                values[key] = values.get(key, 0.0) + s.value
    hits = sum(v for (n, _), v in values.items() if n == "brisk_prefix_cache_hits_total")
    queries = sum(v for (n, _), v in values.items() if n == "brisk_prefix_cache_queries_total")
    sent = [int(values.get(("brisk_router_requests_total", str(r)), 0)) for r in range(2)]
    return hits / queries, sent


def test_data_parallel_prefix_routing_beats_round_robin(tmp_path):
    path = tmp_path / "m"
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=384)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # the two servers side by side: most of the time is their start-up
        runs = [pool.submit(_shared_prompt_hit_rate, path, policy) for policy in ("prefix", "round-robin")]
        (prefix, sent), (round_robin, sent_rr) = (r.result() for r in runs)
    print(f"prefix-cache hit rate: prefix-aware {prefix:.3f} (requests per replica {sent}), "
          f"round-robin {round_robin:.3f} ({sent_rr})")
    assert sent_rr == [13, 12] and min(sent) > 0  # both replicas served
    assert prefix > round_robin
