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


@pytest.mark.parametrize("kind", ["float", "int4", "int8"])
def test_row_and_column_shards_equal_full_linear(kind):
    n, k = 64, 128
    lin = _float_linear(n, k) if kind == "float" else _quant_linear(n, k, 4 if kind == "int4" else 8, 32)
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
    ref = [o.outputs[0].token_ids for o in LLM(str(path), max_model_len=256).generate(prompts, params)]
    llm = LLM(str(path), max_model_len=256, tensor_parallel_size=2, distributed_timeout=30)
    try:
        runner = llm.engine.runner
        procs = list(runner.state.procs)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()
    assert out == ref
    assert all(not p.is_alive() for p in procs)  # no leaked worker


def test_pipeline_parallel_is_refused():
    with pytest.raises(ValueError, match="pipeline parallelism is not finished"):
        LLM(pipeline_parallel_size=2)


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
                   if "spawn_main" in " ".join(p.cmdline())]
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
