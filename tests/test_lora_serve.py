"""Adapters on the OpenAI server: the `model` field picks one, /v1/models lists them, load / unload at run time,
unknown names 404 in the OpenAI error format."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from hf_utils import make_tiny_hf_model

from brisk import LLM
from brisk.serve.app import ServerConfig, create_app

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-serve")
    ref = make_tiny_hf_model(tmp / "m", "llama", seed=3)
    for i, name in enumerate(("a", "b")):
        pm = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.3)
        pm.save_pretrained(tmp / name)
        ref = pm.unload()
    llm = LLM(str(tmp / "m"), max_model_len=64, kv_cache_memory="4MiB", enable_lora=True, max_loras=2,
              max_lora_rank=8)
    app = create_app(llm.engine, ServerConfig(served_model_name="tiny", lora_modules={"a": str(tmp / "a")},
                                              allowed_hosts=["testserver"]))  # TestClient's Host
    with TestClient(app) as client:
        yield tmp, client, llm


def test_model_field_selects_the_adapter(setup):
    tmp, client, llm = setup
    ids = [o["id"] for o in client.get("/v1/models").json()["data"]]
    assert ids == ["tiny", "a"]
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    got = {m: client.post("/v1/completions", json={**body, "model": m}).json()["choices"][0]["text"]
           for m in ("tiny", "a")}
    assert got["a"] != got["tiny"]
    r = client.post("/v1/completions", json={**body, "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_at_run_time(setup):
    tmp, client, _ = setup
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(tmp / "b")})
    assert r.status_code == 200, r.text
    assert "b" in [o["id"] for o in client.get("/v1/models").json()["data"]]
    body = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    bad = client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(tmp / "missing")})
    assert bad.status_code == 400 and "adapter" in bad.json()["error"]["message"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    assert client.post("/v1/chat/completions", json=body).status_code == 404
