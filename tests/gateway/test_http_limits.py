"""The gateway's own limits over real HTTP (uvicorn, httpx, the OpenAI SDK) in front of a fake stage:
several API keys from a keys file, CORS only for the allowed origins, 413 for a long body, 429 with
Retry-After for requests in flight beyond a key's or the server's cap; every refusal an OpenAI envelope."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from gateway.app import GatewayConfig, create_app
from gateway.http.api_keys import parse_api_keys, read_api_key_file
from stagemesh_core.errors import UserError

from .conftest import MODEL
from .fakes import AppServer, wait_for

KEYS_FILE = """\
# who holds which key
key-alice-0001  alice
key-bob-0002    bob
key-carol-0003
#key-revoked-0004
"""
ORIGIN = "http://ui.example:3000"
LIMIT = 4000


@pytest.fixture(scope="module")
def limited(tmp_path_factory, mesh, tokenizer, eos_ids):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEYS_FILE)
    config = GatewayConfig(served_model_name=MODEL, max_model_len=2048, api_keys=read_api_key_file(str(path)),
                           allowed_origins=(ORIGIN,), max_request_bytes=LIMIT, max_concurrent_requests=2,
                           max_concurrent_requests_per_key=1)
    server = AppServer(create_app(config, mesh=mesh, tokenizer=tokenizer, eos_token_ids=eos_ids)).start()
    yield server
    server.stop()


def _sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=20)


def _envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_keys_file_parsing():
    assert parse_api_keys(KEYS_FILE, "f") == ("key-alice-0001", "key-bob-0002", "key-carol-0003")
    with pytest.raises(UserError, match="holds no API key"):
        parse_api_keys("# nothing\n\n", "f")
    with pytest.raises(UserError, match="f line 2"):
        parse_api_keys("ok-key\nkey\x01bad\n", "f")


def test_every_key_in_the_file_is_accepted_and_a_commented_one_is_not(limited, stage):
    for key in ("key-alice-0001", "key-bob-0002", "key-carol-0003"):
        reply = _sdk(limited, key).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert reply.choices[0].text
    with pytest.raises(openai.AuthenticationError):
        _sdk(limited, "key-revoked-0004").completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_cors_answers_only_the_allowed_origin(limited, server, stage):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{limited.url}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{limited.url}/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    # A refused request still carries the header, so the page can read its 401.
    refused = httpx.post(f"{limited.url}/v1/models", headers={"Origin": ORIGIN})
    assert refused.headers.get("access-control-allow-origin") == ORIGIN
    # Off by default: the plain server answers no origin at all.
    default = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert "access-control-allow-origin" not in default.headers


def test_a_body_over_the_limit_is_413_declared_or_chunked(limited, stage):
    headers = {"Authorization": "Bearer key-alice-0001", "Content-Type": "application/json"}
    big = b'{"model": "%s", "prompt": "%s", "max_tokens": 1}' % (MODEL.encode(), b"x" * LIMIT)
    error = _envelope(httpx.post(f"{limited.url}/v1/completions", content=big, headers=headers), 413)
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]

    def chunks():  # no Content-Length: the limit must hold while reading
        for i in range(0, len(big), 500):
            yield big[i:i + 500]

    _envelope(httpx.post(f"{limited.url}/v1/completions", content=chunks(), headers=headers), 413)
    with pytest.raises(openai.APIStatusError) as sdk:
        _sdk(limited, "key-alice-0001").completions.create(model=MODEL, prompt="x" * LIMIT, max_tokens=1)
    assert sdk.value.status_code == 413
    small = httpx.post(f"{limited.url}/v1/completions", headers=headers,
                       content=b'{"model": "%s", "prompt": "hi", "max_tokens": 1}' % MODEL.encode())
    assert small.status_code == 200


def _hold_stream(server, key: str, opened: threading.Event, release: threading.Event) -> None:
    stream = _sdk(server, key).completions.create(model=MODEL, prompt="hi", max_tokens=50, stream=True)
    next(iter(stream))  # the first token: the request is in flight
    opened.set()
    release.wait(20)
    stream.close()  # the client leaves; its slot must come back


def _refusal(server, key: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 1})


def test_requests_in_flight_beyond_a_cap_get_429_with_retry_after(limited, stage, healthy_mesh):
    # healthy_mesh: one replica, whatever an earlier test left, so both streams reach the stage that hangs.
    stage.script.hang_after_tokens = 1  # each stream stays open after its first token until the client leaves
    release = threading.Event()
    holders = []
    try:
        for key in ("key-alice-0001", "key-bob-0002"):
            opened = threading.Event()
            thread = threading.Thread(target=_hold_stream, args=(limited, key, opened, release), daemon=True)
            thread.start()
            holders.append(thread)
            assert opened.wait(20)
        per_key = _refusal(limited, "key-alice-0001")
        error = _envelope(per_key, 429)
        assert per_key.headers["retry-after"] == "1" and error["type"] == "rate_limit_error"
        assert error["code"] == "rate_limit_exceeded" and "--max-concurrent-requests-per-key" in error["message"]
        whole = _refusal(limited, "key-carol-0003")  # carol has none running, but the server holds 2 of 2
        assert "(--max-concurrent-requests)" in _envelope(whole, 429)["message"]
        with pytest.raises(openai.RateLimitError):
            _sdk(limited, "key-carol-0003").completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert httpx.get(f"{limited.url}/health").status_code == 200  # probes are never capped
    finally:
        release.set()
        for thread in holders:
            thread.join(20)
    stage.script.hang_after_tokens = None
    assert wait_for(lambda: _refusal(limited, "key-alice-0001").status_code == 200, 10)
    assert _refusal(limited, "key-carol-0003").status_code == 200
