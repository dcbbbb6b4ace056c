"""`brisk serve` against what a web page can make a browser send: bodies not sent as JSON (a "simple" cross-origin
POST), forged Origin headers, and Host headers of a DNS-rebound name. Plain clients (no Origin, JSON bodies, the
openai client) keep working, as do the GET routes.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_serve import MODEL, model_dir  # noqa: F401 - the tiny model, shared with test_serve

from brisk.serve.process import ServerProcess
from brisk.serve.security import AccessPolicy, is_loopback, split_host

GOOD = "http://good.test"
BODY = {"model": MODEL, "prompt": "Emma Woodhouse", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    # --cors-origins: the older name of --allowed-origins, still accepted
    with ServerProcess(["--model", model_dir, "--served-model-name", MODEL, "--max-model-len", "128",
                        "--kv-cache-memory", "8MiB", "--cors-origins", GOOD, "--allowed-hosts", "brisk.lan"],
                       startup_timeout_s=90) as proc:
        yield proc


def post(server: ServerProcess, headers: dict[str, str] | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", headers=headers, timeout=30, **kw)


def error_of(resp: httpx.Response) -> dict:
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---------------------------------------------------------------------------------------------- Content-Type
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx", None])
def test_a_body_not_sent_as_json_is_a_415(server, content_type):
    headers = {"Content-Type": content_type} if content_type is not None else {}
    resp = post(server, headers, content=json.dumps(BODY).encode())
    assert resp.status_code == 415, resp.text
    error = error_of(resp)
    assert "Content-Type: application/json" in error["message"] and error["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_json_bodies_with_or_without_charset_are_answered(server, content_type):
    resp = post(server, {"Content-Type": content_type}, content=json.dumps(BODY).encode())
    assert resp.status_code == 200, resp.text


# ---------------------------------------------------------------------------------------------- Origin
def test_a_foreign_origin_is_refused(server):
    for origin in ("http://evil.test", "null", "http://good.test:8080", "https://good.test",
                   f"http://localhost:{server.port + 1}"):
        resp = post(server, {"Origin": origin}, json=BODY)
        assert resp.status_code == 403, (origin, resp.text)
        error = error_of(resp)
        assert "--allowed-origins" in error["message"] and error["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in resp.headers
    # a preflight too: the browser never gets to send the request
    resp = httpx.options(f"{server.base_url}/completions", timeout=10, headers={
        "Origin": "http://evil.test", "Access-Control-Request-Method": "POST"})
    assert resp.status_code == 403 and "access-control-allow-origin" not in resp.headers
    # GETs as well: a page may not read the model list or the metrics either
    assert httpx.get(f"{server.url}/metrics", headers={"Origin": "http://evil.test"}, timeout=10).status_code == 403


def test_the_allowed_origin_gets_cors(server):
    resp = post(server, {"Origin": GOOD}, json=BODY)
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == GOOD
    resp = httpx.options(f"{server.base_url}/completions", timeout=10, headers={
        "Origin": GOOD, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == GOOD


def test_the_servers_own_origin_is_answered(server):
    # /docs' "Try it out" is such a request: the page is served by brisk itself
    for origin, host in [(server.url, f"127.0.0.1:{server.port}"), (f"http://localhost:{server.port}",
                                                                     f"localhost:{server.port}")]:
        assert post(server, {"Origin": origin, "Host": host}, json=BODY).status_code == 200, origin


# ---------------------------------------------------------------------------------------------- Host
def test_a_rebound_host_is_refused(server):
    # DNS rebinding: evil.test re-pointed at 127.0.0.1, so the page's own origin matches the Host it sends
    for headers in ({"Host": f"evil.test:{server.port}"},
                    {"Host": f"evil.test:{server.port}", "Origin": f"http://evil.test:{server.port}"},
                    {"Host": "192.168.1.10"}):
        resp = post(server, headers, json=BODY)
        assert resp.status_code == 403, (headers, resp.text)
        error = error_of(resp)
        assert "--allowed-hosts" in error["message"] and error["code"] == "host_not_allowed"
        assert httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10).status_code == 403


def test_loopback_and_listed_hosts_are_answered(server):
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}", "localhost",
                 "brisk.lan", f"BRISK.LAN:{server.port}"):
        assert post(server, {"Host": host}, json=BODY).status_code == 200, host


# ---------------------------------------------------------------------------------------------- plain clients
def test_plain_clients_and_the_openai_client_still_work(server):
    for path in ("/health", "/metrics", "/v1/models", "/openapi.json", "/docs"):
        assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 200, path
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    assert client.completions.create(model=MODEL, prompt="Emma", max_tokens=2).usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          stream=True)
    assert any(c.choices and c.choices[0].finish_reason for c in chat)


def test_refusals_are_counted_and_nothing_went_wrong(server):
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'status="403"' in metrics and 'status="415"' in metrics and 'status="5' not in metrics
    assert "Traceback" not in server.log()


# ---------------------------------------------------------------------------------------------- the policy itself
def test_the_default_policies():
    loopback = AccessPolicy("127.0.0.1")
    assert loopback.refusal("GET", {"host": "localhost:8000"}) is None
    assert loopback.refusal("GET", {"host": "[::1]:8000"}) is None
    assert loopback.refusal("GET", {"host": "127.0.0.2"}) is None
    assert loopback.refusal("GET", {"host": "app.localhost"}) is None  # browsers resolve *.localhost themselves
    assert loopback.refusal("GET", {}) is None  # HTTP/1.0 without Host: not a browser
    assert loopback.refusal("GET", {"host": "attacker.example:8000"})[0] == 403
    assert loopback.refusal("GET", {"host": "localhost.attacker.example"})[0] == 403
    # bound to every interface: any Host (the network reaches it anyway), but still no foreign Origin
    anywhere = AccessPolicy("0.0.0.0")
    assert anywhere.refusal("GET", {"host": "gpu-box.lan:8000"}) is None
    assert anywhere.refusal("POST", {"host": "gpu-box.lan:8000", "content-type": "application/json",
                                     "origin": "http://gpu-box.lan:8000"}) is None
    assert anywhere.refusal("POST", {"host": "gpu-box.lan:8000", "content-type": "application/json",
                                     "origin": "http://evil.test"})[0] == 403
    assert anywhere.refusal("POST", {"host": "gpu-box.lan:8000", "content-type": "text/plain"})[0] == 415
    # --allowed-hosts on such a server narrows it; '*' opens a loopback one
    narrowed = AccessPolicy("0.0.0.0", allowed_hosts=["gpu-box.lan"])
    assert narrowed.refusal("GET", {"host": "gpu-box.lan:8000"}) is None
    assert narrowed.refusal("GET", {"host": "other.lan"})[0] == 403
    assert AccessPolicy("127.0.0.1", allowed_hosts=["*"]).refusal("GET", {"host": "anything"}) is None
    assert AccessPolicy("::1").refusal("GET", {"host": "[::1]:8000"}) is None
    anyone = AccessPolicy(allowed_origins=["*"])
    assert anyone.refusal("GET", {"host": "localhost", "origin": "http://evil.test"}) is None


def test_same_origin_ports_and_schemes():
    p = AccessPolicy()
    assert p.origin_allowed("http://localhost", "localhost:80")
    assert p.origin_allowed("http://localhost:80", "localhost")
    assert p.origin_allowed("https://localhost", "localhost:443")
    assert not p.origin_allowed("http://localhost:8001", "localhost:8000")
    assert not p.origin_allowed("http://localhost:notaport", "localhost:8000")
    assert p.origin_allowed("http://[::1]:8000", "[::1]:8000")


def test_option_values_are_checked():
    assert AccessPolicy(allowed_origins=["HTTP://Good.Test/"]).allowed_origins == ["http://good.test"]
    for bad in ("good.test", "http://good.test/path", "ftp://good.test"):
        with pytest.raises(ValueError, match="--allowed-origins"):
            AccessPolicy(allowed_origins=[bad])
    assert split_host("[::1]:8000") == ("::1", 8000) and split_host("Example.COM.") == ("example.com", None)
    assert is_loopback("LOCALHOST") and is_loopback("127.1.2.3") and not is_loopback("10.0.0.1")


def test_the_router_runs_the_same_checks():
    """The data-parallel router refuses before forwarding (its replica here does not exist: a refusal never
    reaches it)."""
    from starlette.testclient import TestClient

    from brisk.serve.router import create_router_app

    app = create_router_app(["http://127.0.0.1:9"], access=AccessPolicy("127.0.0.1", allowed_origins=[GOOD]))
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        assert client.post("/v1/completions", content=b"{}", headers={"Content-Type": "text/plain"}).status_code == 415
        resp = client.post("/v1/completions", json=BODY, headers={"Origin": "http://evil.test"})
        assert resp.status_code == 403 and error_of(resp)["code"] == "origin_not_allowed"
        resp = client.post("/v1/completions", json=BODY, headers={"Host": "evil.test:8000"})
        assert resp.status_code == 403 and error_of(resp)["code"] == "host_not_allowed"
        preflight = client.options("/v1/completions", headers={"Origin": GOOD, "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == GOOD
