"""LoRA adapters against PEFT (the oracle): forward with and without merging, mixed batches, slots and errors."""

from __future__ import annotations

import json

import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk import LLM, LoRARequest, SamplingParams
from brisk.lora.adapter import AdapterError, load_adapter, merge_adapter, parse_target_modules
from brisk.lora.layers import LoRAMapping
from brisk.lora.manager import LoRABusyError, LoRAManager
from brisk.model.loader import load_model
from brisk.ops.attention import AttentionMetadata

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(ref, folder, r=4, alpha=8, targets=ALL, seed=0, rslora=False):
    """A PEFT adapter on the HF model `ref` with random (nonzero) B, saved to `folder`; returns the PeftModel."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora)
    pm = peft.get_peft_model(ref, cfg, adapter_name="default")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    pm.save_pretrained(folder)
    return pm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    ref = make_tiny_hf_model(tmp / "m", "llama", num_kv_heads=2, tie_word_embeddings=False, seed=1)
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = ref(ids[None]).logits[0]
    want = {}
    for name, kw in (("a", {"seed": 1}), ("b", {"seed": 2, "r": 8, "targets": ["q_proj", "v_proj", "down_proj"]}),
                     ("c", {"seed": 3, "rslora": True})):
        pm = make_adapter(ref, tmp / name, **kw)
        with torch.no_grad():
            want[name] = pm(ids[None]).logits[0]
        ref = pm.unload()  # the plain base again for the next adapter
    return tmp, ids, base_logits, want


def prefill_logits(loaded, ids):
    c, n = loaded.config, ids.shape[0]
    nb = (n + 15) // 16
    kv = [torch.zeros(2, nb, 16, c.num_key_value_heads, c.head_dim) for _ in range(c.num_hidden_layers)]
    meta = AttentionMetadata.for_sequences([n], [n], [list(range(nb))], 16)
    with torch.inference_mode():
        return loaded.model(ids, torch.arange(n), meta, kv).float()


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_forward_equals_peft(tiny, fuse, name):
    """The runtime layers (fused q/k/v and gate/up slices, or plain ones) give PEFT's logits."""
    tmp, ids, _, want = tiny
    loaded = load_model(tmp / "m", fuse=fuse)
    mgr = LoRAManager(loaded.model, max_loras=2, max_lora_rank=8)
    slot, _ = mgr.acquire(LoRARequest(name, 1, str(tmp / name)))
    mgr.state.mapping = LoRAMapping.from_row_slots([slot] * ids.shape[0])
    torch.testing.assert_close(prefill_logits(loaded, ids), want[name], atol=1e-4, rtol=1e-4)


def test_merged_equals_peft_merge_and_unload(tiny):
    tmp, ids, _, want = tiny
    loaded = load_model(tmp / "m", fuse=False)
    merge_adapter(loaded.model, load_adapter(tmp / "a"))
    torch.testing.assert_close(prefill_logits(loaded, ids), want["a"], atol=1e-4, rtol=1e-4)


def test_export_merged_folder_equals_peft(tiny, tmp_path):
    """`brisk export merged` writes a plain folder whose fused runtime model gives PEFT's adapted logits."""
    from click.testing import CliRunner

    from brisk.cli import main

    tmp, ids, _, want = tiny
    out = tmp_path / "merged"
    result = CliRunner().invoke(main, ["export", "merged", str(tmp / "m"), str(tmp / "c"), str(out)])
    assert result.exit_code == 0, result.output
    assert "projections merged" in result.output
    record = json.loads((out / "config.json").read_text())["merged_lora"]
    assert record["use_rslora"] and record["r"] == 4
    torch.testing.assert_close(prefill_logits(load_model(out), ids), want["c"], atol=1e-4, rtol=1e-4)
    again = CliRunner().invoke(main, ["export", "merged", str(tmp / "m"), str(tmp / "c"), str(out)])
    assert again.exit_code != 0 and "not empty" in again.output


def test_export_merged_refuses_a_quantized_base(tiny, tmp_path):
    from click.testing import CliRunner

    from brisk.cli import main
    from brisk.lora.export import export_merged

    tmp, _, _, _ = tiny
    q = CliRunner().invoke(main, ["quantize", "--method", "rtn", "--bits", "4", "--group-size", "32", str(tmp / "m"),
                                  str(tmp_path / "q")])
    assert q.exit_code == 0, q.output
    with pytest.raises(ValueError, match="quantized or compressed"):
        export_merged(str(tmp_path / "q"), tmp / "a", tmp_path / "out")


def test_mixed_batch_equals_one_at_a_time(tiny):
    """Requests for two adapters and for none in one batch: each gets exactly the tokens it gets alone."""
    tmp, ids, _, _ = tiny
    llm = LLM(str(tmp / "m"), max_model_len=128, kv_cache_memory="4MiB", enable_lora=True, max_loras=2,
              max_lora_rank=8)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a, b = LoRARequest("a", 1, str(tmp / "a")), LoRARequest("b", 2, str(tmp / "b"))
    prompts = [ids[:10].tolist(), ids[5:20].tolist(), ids[2:9].tolist(), ids[:10].tolist()]
    loras = [a, b, None, b]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=loras)]
    alone = [llm.generate([p], sp, lora_request=[r])[0].outputs[0].token_ids
             for p, r in zip(prompts, loras, strict=True)]
    assert together == alone
    assert together[0] != together[3]  # same prompt, other adapter: other tokens
    plain = LLM(str(tmp / "m"), max_model_len=128, kv_cache_memory="4MiB")
    assert together[2] == plain.generate([prompts[2]], sp)[0].outputs[0].token_ids  # no adapter: the base path


def test_stream_with_an_adapter_equals_generate(tiny):
    """LLM.stream takes the adapter as generate does: the streamed tokens and text are generate's."""
    tmp, ids, _, _ = tiny
    llm = LLM(str(tmp / "m"), max_model_len=128, kv_cache_memory="4MiB", enable_lora=True, max_lora_rank=8)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = LoRARequest("a", 1, str(tmp / "a"))
    want = llm.generate([ids[:10].tolist()], sp, lora_request=a)[0].outputs[0]
    outs = list(llm.stream(ids[:10].tolist(), sp, lora_request=a))
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == want.token_ids
    assert "".join(o.outputs[0].text_delta for o in outs) == want.text
    assert want.token_ids != list(llm.stream(ids[:10].tolist(), sp))[-1].outputs[0].token_ids  # the base differs


def test_prefix_cache_never_shared_between_adapters(tiny):
    tmp, ids, _, _ = tiny
    llm = LLM(str(tmp / "m"), max_model_len=128, kv_cache_memory="4MiB", enable_lora=True, max_loras=2,
              max_lora_rank=8)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = torch.arange(3, 43).tolist()  # 40 tokens: two full blocks of 16
    a, b = LoRARequest("a", 1, str(tmp / "a")), LoRARequest("b", 2, str(tmp / "b"))
    cached = [llm.generate([prompt], sp, lora_request=r)[0].metrics.num_cached_tokens for r in (a, b, None, a, b)]
    assert cached == [0, 0, 0, 32, 32]


def test_slots_lru_eviction_and_busy(tiny):
    tmp, _, _, _ = tiny
    loaded = load_model(tmp / "m")
    mgr = LoRAManager(loaded.model, max_loras=2, max_lora_rank=8)
    reqs = [LoRARequest(n, i + 1, str(tmp / n)) for i, n in enumerate("abc")]
    s0, _ = mgr.acquire(reqs[0])
    s1, _ = mgr.acquire(reqs[1])
    with pytest.raises(LoRABusyError, match="max_loras=2"):
        mgr.acquire(reqs[2])
    mgr.release(s0)
    s2, _ = mgr.acquire(reqs[2])  # evicts the idle "a"
    assert s2 == s0 and [r.lora_name for r in mgr.loaded()] == ["c", "b"]
    with pytest.raises(LoRABusyError, match="in use"):
        mgr.remove(2)
    mgr.release(s1)
    assert mgr.remove(2) and not mgr.remove(2)
    assert float(mgr.layers[0].lora_a[s1].abs().sum()) == 0.0  # an unloaded slot holds nothing


def test_bad_adapters_are_refused(tiny, tmp_path):
    tmp, _, _, _ = tiny
    loaded = load_model(tmp / "m")
    mgr = LoRAManager(loaded.model, max_loras=2, max_lora_rank=4)
    with pytest.raises(AdapterError, match="rank 8, more than max_lora_rank=4"):
        mgr.acquire(LoRARequest("b", 2, str(tmp / "b")))
    with pytest.raises(AdapterError, match="lacks adapter_config.json"):
        mgr.acquire(LoRARequest("x", 3, str(tmp_path)))
    other = make_tiny_hf_model(tmp_path / "other", "llama", hidden_size=96, num_kv_heads=2, seed=0)
    make_adapter(other, tmp_path / "wrong")
    with pytest.raises(AdapterError, match="does not fit this base model"):
        mgr.acquire(LoRARequest("w", 4, str(tmp_path / "wrong")))
    assert all(s is None for s in mgr.slots)  # nothing half-loaded
    with pytest.raises(AdapterError, match="not a projection"):
        parse_target_modules("q,k,lm_head")
    cfg = json.loads((tmp / "a" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"


def test_adapter_request_needs_enable_lora(tiny):
    tmp, ids, _, _ = tiny
    llm = LLM(str(tmp / "m"), max_model_len=128, kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([ids[:5].tolist()], lora_request=LoRARequest("a", 1, str(tmp / "a")))
    assert not llm.engine.has_unfinished_requests()


def test_adapter_steps_run_the_plan_and_cpp_loop_and_equal_the_module_path(tiny):
    """Steps with adapter rows take the base executor's paths with the adapters added after each base kernel:
    the prefill (17 rows) the decode plan's Python loop, decode steps the C++ layer loop (applied per row inside
    it); their tokens and logprobs equal the module path's (the LoRALinear layers)."""
    from brisk.ops import kernels

    ops = kernels.get_ops()
    if ops is None or not hasattr(ops, "decode_layers"):  # a machine without a C++ compiler: no loop to test
        pytest.skip("the C++ layer loop (ops/csrc/decode_layers.cpp) is not built on this machine")
    tmp, ids, _, _ = tiny
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    a, c = LoRARequest("a", 1, str(tmp / "a")), LoRARequest("c", 3, str(tmp / "c"))
    prompts = [ids[:6].tolist(), ids[4:9].tolist(), ids[1:7].tolist()]
    loras = [a, None, c]
    runs = {}
    for execution in ("auto", "modules"):
        llm = LLM(str(tmp / "m"), max_model_len=128, kv_cache_memory="4MiB", enable_lora=True, max_loras=2,
                  max_lora_rank=8, execution=execution)
        executor = llm.engine.runner.executor
        plan = getattr(executor.base, "plan", None)
        calls: list[str] = []
        if execution == "auto":
            assert plan is not None and executor.cpp_lora, "the C++ loop is built, so adapter steps must use it"
            run_cpp, run = plan.run_cpp, plan.run
            plan.run_cpp = lambda *args, _f=run_cpp, _p=plan, _c=calls: (_c.append(f"cpp {_p.lora_rows is not None}"),
                                                                         _f(*args))[1]
            plan.run = lambda *args, _f=run, _p=plan, _c=calls: (_c.append(f"plan {_p.lora_active}"), _f(*args))[1]
        outs = llm.generate(prompts, sp, lora_request=loras)
        runs[execution] = ([o.outputs[0].token_ids for o in outs],
                           [[next(iter(d.values())) for d in o.outputs[0].logprobs] for o in outs], calls)
    assert runs["auto"][2][0] == "plan True" and "cpp True" in runs["auto"][2], runs["auto"][2]
    assert runs["auto"][0] == runs["modules"][0]
    torch.testing.assert_close(torch.tensor(runs["auto"][1]), torch.tensor(runs["modules"][1]), atol=1e-4, rtol=0)


def test_before_after_answers(tiny, tmp_path):
    """brisk.lora.answers: the base's and the adapter's greedy answers to each chat, side by side."""
    from brisk.lora.answers import compare_answers, markdown_table

    tmp, *_ = tiny
    chats = [{"messages": [{"role": "user", "content": f"Say {w} | twice"}, {"role": "assistant", "content": w}]}
             for w in ("yes", "no", "maybe")]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    rows = compare_answers(tmp / "a", data, model=str(tmp / "m"), count=2, max_tokens=6, max_model_len=128,
                           kv_cache_memory="4MiB")
    assert [r["reference"] for r in rows] == ["yes", "no"] and rows[0]["prompt"] == "Say yes | twice"
    plain = LLM(str(tmp / "m"), max_model_len=128, kv_cache_memory="4MiB")
    sp = SamplingParams(temperature=0, max_tokens=6)
    assert rows[1]["base"] == plain.chat(chats[1]["messages"][:1], sp)[0].outputs[0].text.strip()
    assert any(r["base"] != r["adapted"] for r in rows)  # the random adapter moves the answers
    table = markdown_table(rows).splitlines()
    assert len(table) == 4 and table[2].startswith("| Say yes \\| twice | yes |")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no chats"):
        compare_answers(tmp / "a", tmp_path / "empty.jsonl", model=str(tmp / "m"))
