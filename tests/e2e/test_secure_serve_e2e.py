"""``stagemesh serve`` locked down, end to end on the default model at PP=2: the gateway over HTTPS with
keys from a file (the OpenAI SDK, unchanged), the stages' gRPC over mutual TLS with certificates made by
``stagemesh certs`` (the coordinator and gateway get through; plaintext, certificate-less and foreign-CA
callers do not), and the mesh token on top."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.serve_process import assert_stops_clean, start_serve

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
KEY = "secure-e2e-key-0001"
TOKEN = "secure-e2e-mesh-token-" + "t" * 20


def _grpcurl() -> str:
    beside = Path(sys.executable).parent / "grpcurl"
    return str(beside) if beside.exists() else "grpcurl"


def _certs(root: Path, *nodes: str) -> None:
    args = [arg for node in nodes for arg in ("--node", node)]
    subprocess.run([sys.executable, "-m", "stagemesh.cli", "certs", str(root), *args], check=True,
                   capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    root = tmp_path_factory.mktemp("secure")
    _certs(root / "mesh", "head=127.0.0.1", "operator=127.0.0.1")  # the gateway's HTTPS uses head's pair too
    _certs(root / "foreign", "intruder=127.0.0.1")
    (root / "keys.txt").write_text(f"# clients\n{KEY} alice\nsecond-key-0002 bob\n")
    head = root / "mesh" / "head"
    serve = start_serve(root, "--api-key-file", str(root / "keys.txt"), "--grpc-tls-dir", str(head),
                        "--ssl-keyfile", str(head / "node.key"), "--ssl-certfile", str(head / "node.pem"),
                        pp=2, env={"STAGEMESH_MESH_TOKEN": TOKEN}, https_ca=str(head / "ca.pem"))
    yield serve, root
    serve.stop()


def test_the_openai_sdk_chats_over_https_with_a_key_from_the_file(secure):
    serve, root = secure
    http = httpx.Client(verify=ssl.create_default_context(cafile=str(root / "mesh" / "head" / "ca.pem")))
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key=KEY, max_retries=0, timeout=120, http_client=http)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content":
                                                                   "What is the capital of France?"}],
                                           temperature=0, max_tokens=24)
    assert "Paris" in reply.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{serve.url}/v1", api_key="not-a-key", max_retries=0, http_client=http).models.list()
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the HTTPS port gets no answer
        httpx.get(f"http://127.0.0.1:{serve.port}/health", timeout=10)


def test_stages_take_only_mesh_certificates(secure):
    serve, root = secure
    stages = serve.mesh()["replicas"][0]["stages"]
    operator, intruder = root / "mesh" / "operator", root / "foreign" / "intruder"
    health = ["-d", '{"service":""}']
    for stage in stages:
        target = f"127.0.0.1:{stage['grpc_port']}"
        ok = subprocess.run([_grpcurl(), "-cacert", str(operator / "ca.pem"), "-cert", str(operator / "node.pem"),
                             "-key", str(operator / "node.key"), *health, target, "grpc.health.v1.Health/Check"],
                            capture_output=True, text=True, timeout=30)
        assert ok.returncode == 0 and json.loads(ok.stdout)["status"] == "SERVING", ok.stderr
        # Calls that must be refused get a short connect timeout: a refused handshake makes grpcurl retry until
        # its timeout (10 s by default), which is all this waits for.
        plaintext = subprocess.run([_grpcurl(), "-plaintext", "-connect-timeout", "2", *health, target,
                                    "grpc.health.v1.Health/Check"], capture_output=True, text=True, timeout=30)
        assert plaintext.returncode != 0
        # A certificate from another CA: refused even though the caller trusts the stage's CA.
        foreign = subprocess.run([_grpcurl(), "-connect-timeout", "2", "-cacert", str(operator / "ca.pem"),
                                  "-cert", str(intruder / "node.pem"),
                                  "-key", str(intruder / "node.key"), *health, target, "grpc.health.v1.Health/Check"],
                                 capture_output=True, text=True, timeout=30)
        assert foreign.returncode != 0
    # With a mesh certificate but no token, GenerateStream is still refused.
    entry = f"127.0.0.1:{stages[0]['grpc_port']}"
    body = json.dumps({"start": {"request_id": "x", "prompt_token_ids": [504, 3575], "max_tokens": 1}})
    untokened = subprocess.run([_grpcurl(), "-cacert", str(operator / "ca.pem"), "-cert", str(operator / "node.pem"),
                                "-key", str(operator / "node.key"), "-d", body, entry,
                                "stagemesh.v1.Stage/GenerateStream"],
                               capture_output=True, text=True, timeout=30)
    assert "Unauthenticated" in untokened.stderr, untokened.stderr


def test_sigterm_to_the_serve_stops_the_secure_mesh_and_leaves_nothing(secure):
    """What launchd does. Runs last: it ends the module's serve."""
    assert_stops_clean(secure[0], "sigterm-to-serve")
