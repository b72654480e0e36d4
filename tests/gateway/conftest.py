"""Fixtures for gateway tests: the real SmolLM2 tokenizer, fake stages, apps on uvicorn."""

from __future__ import annotations

import pytest

from gateway.app import GatewayConfig, create_app

from .fakes import AppServer, FakeMesh, FakeStage, StageServer

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def tokenizer():
    from stage_worker.checkpoint.default_model import resolve_model_path
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.checkpoint.tokenizer import load_tokenizer

    return load_tokenizer(read_model_spec(resolve_model_path(None)))


@pytest.fixture(scope="session")
def eos_ids() -> frozenset[int]:
    return frozenset({2})


@pytest.fixture(scope="session")
def stages():
    """Two fake entry stages (two replicas), answering GenerateStream as the real entry stage does."""
    servers = [StageServer(FakeStage(eos_id=2)).start() for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def stage(stages, tokenizer):
    """Replica 0's fake, reset to reply 'Hello there!' then EOS; replica 1 reset too."""
    for s in stages:
        s.servicer.reset(reply_ids=tokenizer.encode("Hello there!", add_special_tokens=False))
    return stages[0].servicer


@pytest.fixture(scope="session")
def mesh(stages) -> FakeMesh:
    return FakeMesh(ports=[stages[0].port])


@pytest.fixture
def healthy_mesh(mesh, stages):
    mesh.healthy.clear()
    mesh.suspect.clear()
    mesh.supervision.clear()
    mesh.ports[:] = [stages[0].port]  # a test may have put a dead port first
    return mesh


def _serve(config: GatewayConfig, mesh, tokenizer, eos_ids):
    return AppServer(create_app(config, mesh=mesh, tokenizer=tokenizer, eos_token_ids=eos_ids)).start()


@pytest.fixture(scope="session")
def server(mesh, tokenizer, eos_ids):
    s = _serve(GatewayConfig(served_model_name=MODEL, max_model_len=2048, request_timeout_s=30), mesh, tokenizer,
               eos_ids)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def keyed_server(mesh, tokenizer, eos_ids):
    s = _serve(GatewayConfig(served_model_name=MODEL, max_model_len=2048, api_keys=(API_KEY, "other")), mesh,
               tokenizer, eos_ids)
    yield s
    s.stop()


@pytest.fixture
def client(server, stage, healthy_mesh):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)
