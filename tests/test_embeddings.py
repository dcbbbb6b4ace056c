"""Embeddings, rerank and score: prefill-only requests through the engine (engine/pooling.py) and their routes
(serve/pooling.py), against transformers' hidden states and the official openai client."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import openai
import pytest
import torch
from hf_utils import make_tiny_hf_model
from test_serve import scrape

from brisk import LLM
from brisk.engine.pooling import default_pooling
from brisk.model.pooling import read_model_pooling
from brisk.serve.process import ServerProcess

PROMPTS = ["Emma Woodhouse, handsome, clever, and rich", "with a comfortable home", "and happy disposition",
           "seemed to unite some of the best blessings", "of existence", "and had lived nearly twenty-one years",
           "in the world with very little", "to distress or vex her."]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-embed")
    make_tiny_hf_model(path, "llama", seed=3)
    return str(path)


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir) -> LLM:
    return LLM(tiny_dir, max_model_len=256, kv_cache_memory="8MiB", dtype="float32")


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_transformers_pooling(tiny_dir, tiny_llm, pooling):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModel.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tok = tiny_llm.get_tokenizer()
    got = tiny_llm.embed(PROMPTS[:4], pooling=pooling)
    for prompt, vec in zip(PROMPTS[:4], got, strict=True):
        with torch.no_grad():
            h = hf(torch.tensor([tok.encode(prompt)])).last_hidden_state[0]  # final-normed, before lm_head
        ref = torch.nn.functional.normalize(h.mean(0) if pooling == "mean" else h[-1], dim=-1)
        assert abs(float(torch.linalg.vector_norm(torch.tensor(vec))) - 1) < 1e-5
        assert float(torch.nn.functional.cosine_similarity(ref, torch.tensor(vec), dim=0)) > 1 - 1e-4
    assert tiny_llm.engine.kv_manager.usage == 0  # nothing held


def test_batch_of_eight_equals_each_alone(tiny_llm):
    for pooling in ("mean", "last", "cls"):
        batched = torch.tensor(tiny_llm.embed(PROMPTS, pooling=pooling))
        alone = torch.tensor([tiny_llm.embed(p, pooling=pooling)[0] for p in PROMPTS])
        assert torch.allclose(batched, alone, atol=1e-5), pooling
    assert tiny_llm.engine.kv_manager.usage == 0 and not tiny_llm.engine.has_unfinished_requests()


def test_chunked_prompt_pools_like_one_chunk(tiny_dir, tiny_llm):
    # a step budget of 16 tokens splits the long prompt into chunks; the pooled state carries across them
    small = LLM(tiny_dir, max_model_len=256, kv_cache_memory="8MiB", dtype="float32", max_num_batched_tokens=16)
    long = " ".join(PROMPTS)
    for pooling in ("mean", "last", "cls"):
        assert torch.allclose(torch.tensor(small.embed(long, pooling=pooling)),
                              torch.tensor(tiny_llm.embed(long, pooling=pooling)), atol=1e-5), pooling


def test_sentence_transformers_pooling_config_is_read(tmp_path, tiny_dir):
    assert default_pooling(tiny_dir) == "last"  # a decoder LLM saying nothing
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_lasttoken": False}))
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [32, 16]}))
    found = read_model_pooling(tmp_path)
    assert (found.pooling, found.normalize, found.matryoshka_dimensions) == ("mean", True, (32, 16))
    assert found.allows_dimensions(16) and not found.allows_dimensions(20)
    assert default_pooling(tmp_path) == "mean"


def test_yes_no_scores_are_probabilities(tiny_llm):
    scores = tiny_llm.score("who is Emma?", PROMPTS[:3])
    assert len(scores) == 3 and all(0 < s < 1 for s in scores)
    cos = tiny_llm.score("who is Emma?", PROMPTS[:3], method="embed")
    assert len(cos) == 3 and all(-1 <= s <= 1 for s in cos)
    assert tiny_llm.engine.kv_manager.usage == 0


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def default_server():
    proc = ServerProcess(["--max-model-len", "512", "--kv-cache-memory", "32MiB"], startup_timeout_s=120)
    proc.start()
    yield proc
    proc.stop()


def test_openai_client_embeddings_float_and_base64(default_server):
    client = openai.OpenAI(base_url=default_server.base_url, api_key="unused", max_retries=0, timeout=60)
    texts = ["The capital of France is Paris.", "I like green apples."]
    out = client.embeddings.create(model=None or client.models.list().data[0].id, input=texts)
    assert [d.index for d in out.data] == [0, 1] and out.usage.prompt_tokens > 0
    vecs = torch.tensor([d.embedding for d in out.data])
    assert vecs.shape[1] == 576 and torch.allclose(vecs.norm(dim=1), torch.ones(2), atol=1e-5)
    raw = httpx.post(f"{default_server.url}/v1/embeddings", json={"input": texts, "encoding_format": "base64"},
                     timeout=60).json()
    decoded = [struct.unpack(f"<{576}f", base64.b64decode(d["embedding"])) for d in raw["data"]]
    assert torch.allclose(torch.tensor(decoded), vecs, atol=1e-6)
    # the openai client asks for base64 itself when no format is given, and decodes it
    ids = client.embeddings.create(model=out.model, input=[[1, 2, 3, 4]], encoding_format="float")
    assert len(ids.data[0].embedding) == 576


def test_rerank_and_score_shapes_and_order(default_server):
    url = default_server.url
    docs = ["Paris is the capital and largest city of France.", "Bananas are rich in potassium."]
    body = {"query": "What is the capital of France?", "documents": docs}
    for path in ("/v1/rerank", "/rerank"):
        res = httpx.post(f"{url}{path}", json=body, timeout=60).json()
        assert [r["index"] for r in res["results"]] == [0, 1], res  # the relevant document first
        assert res["results"][0]["relevance_score"] > res["results"][1]["relevance_score"]
        assert res["results"][0]["document"] == {"text": docs[0]}
    res = httpx.post(f"{url}/v1/rerank", json={**body, "top_n": 1, "return_documents": False}, timeout=60).json()
    assert len(res["results"]) == 1 and res["results"][0].get("document") is None
    res = httpx.post(f"{url}/v1/score", json={"text_1": body["query"], "text_2": docs}, timeout=60).json()
    assert [d["index"] for d in res["data"]] == [0, 1] and res["data"][0]["score"] > res["data"][1]["score"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 64}, "dimensions"),
    ("/v1/embeddings", {"input": "word " * 600}, "input"),
    ("/v1/embeddings", {"input": [[10**7]]}, "input"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
])
def test_bad_input_is_400_naming_the_field(default_server, path, body, param):
    resp = httpx.post(f"{default_server.url}{path}", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_counted_per_task_and_nothing_held(default_server):
    metrics = scrape(default_server)
    assert metrics["brisk_task_requests_total{task=embed}"] >= 2
    assert metrics["brisk_task_requests_total{task=rerank}"] >= 2
    assert metrics["brisk_task_prompt_tokens_total{task=score}"] > 0
    assert metrics["brisk_kv_blocks_in_use"] == 0 and metrics["brisk_num_sequences_admitted"] == 0
