"""``stagemesh chat``: an interactive terminal chat against a running gateway.

Streams each answer as it is generated and keeps the conversation history, so
the model sees the whole dialogue every turn. Type ``/reset`` to start over,
``/exit`` (or Ctrl-D) to leave. Uses the gateway's OpenAI chat endpoint, so it
works against any OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

from stagemesh_core import settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default %(default)s)")
    parser.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    parser.add_argument("--api-key", default=None, help="default $STAGEMESH_API_KEY")
    parser.add_argument("--system", default=None, help="a system prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=512)


def stream_reply(client, url: str, body: dict) -> Iterator[str]:
    """Yield text deltas of one streamed chat completion."""
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            response.read()
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise RuntimeError(f"HTTP {response.status_code}: {message}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "the server failed"))
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    yield text


def run(args: argparse.Namespace) -> int:
    import httpx

    key = args.api_key or settings.API_KEY
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = args.url.rstrip("/")
    with httpx.Client(headers=headers, timeout=httpx.Timeout(600.0, connect=5.0)) as client:
        try:
            model = args.model or client.get(f"{base}/v1/models").raise_for_status().json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError) as exc:
            print(f"stagemesh chat: cannot reach the gateway at {base}: {exc}", file=sys.stderr)
            return 2
        print(f"chatting with {model} at {base} (/reset to start over, /exit to leave)")
        history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        while True:
            try:
                line = input("you> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip() == "/reset":
                history = history[:1] if args.system else []
                print("(history cleared)")
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            body = {"model": model, "messages": history, "stream": True,
                    "temperature": args.temperature, "max_tokens": args.max_tokens}
            print(f"{model}> ", end="", flush=True)
            reply = []
            try:
                for text in stream_reply(client, f"{base}/v1/chat/completions", body):
                    reply.append(text)
                    print(text, end="", flush=True)
            except (RuntimeError, httpx.HTTPError) as exc:
                print(f"\n[error: {exc}]")
                history.pop()
                continue
            except KeyboardInterrupt:
                print("\n[interrupted]")
            print()
            history.append({"role": "assistant", "content": "".join(reply)})
