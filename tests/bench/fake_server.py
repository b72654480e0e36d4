"""A small real OpenAI-compatible streaming server for the bench tests, on 127.0.0.1 only.

Streams ``max_tokens`` tokens per request: the first after ``first_delay``,
each next one ``token_delay`` after the one before; every ``fail_every``-th request (counted
from 0, in arrival order) gets a 503 instead. It records every request body.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeServer:
    model: str
    token_delay: float
    first_delay: float = 0.02
    fail_every: int | None = None  # request n fails when n % fail_every == fail_every - 1
    send_usage: bool = True
    api_key: str | None = None
    bodies: list[dict] = field(default_factory=list)
    port: int = 0

    def app(self) -> FastAPI:
        app = FastAPI()
        counter = iter(range(10**9))

        def unauthorized(request: Request) -> JSONResponse | None:
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "bad api key"}}, status_code=401)
            return None

        @app.get("/v1/models")
        async def models(request: Request):
            return unauthorized(request) or {"object": "list", "data": [{"id": self.model, "object": "model"}]}

        async def generate(request: Request, chat: bool):
            if (denied := unauthorized(request)) is not None:
                return denied
            body = await request.json()
            self.bodies.append(body)
            n = next(counter)
            if body.get("model") != self.model:
                return JSONResponse({"error": {"message": f"no model {body.get('model')}"}}, status_code=404)
            if self.fail_every and n % self.fail_every == self.fail_every - 1:
                return JSONResponse({"error": {"message": "overloaded (test)"}}, status_code=503)
            usage = bool((body.get("stream_options") or {}).get("include_usage")) and self.send_usage
            return StreamingResponse(self._stream(body["max_tokens"], chat, usage), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await generate(request, chat=True)

        return app

    async def _stream(self, max_tokens: int, chat: bool, usage: bool):
        for i in range(max_tokens):
            # Relative sleeps: a late token delays the next ones instead of bursting to catch up, so the
            # gaps stay near token_delay even on a busy machine.
            await asyncio.sleep(self.first_delay if i == 0 else self.token_delay)
            text = f" {i + 6},"
            finish = "length" if i == max_tokens - 1 else None
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            yield f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
        if usage:
            use = {"prompt_tokens": 7, "completion_tokens": max_tokens, "total_tokens": 7 + max_tokens}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': use})}\n\n"
        yield "data: [DONE]\n\n"

    def start(self) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
