"""A client the two-host test runs *inside* host A's namespace; prints one JSON document.

    python netns_client.py mesh URL
    python netns_client.py complete URL MODEL N PROMPT...   (N concurrent rounds over the prompts)
    python netns_client.py chat URL MODEL QUESTION
    python netns_client.py refused HOST PORT                (true when nothing listens there)
"""

from __future__ import annotations

import json
import socket
import sys
from concurrent.futures import ThreadPoolExecutor


def main(argv: list[str]) -> None:
    command, *rest = argv
    if command == "mesh":
        import httpx

        print(json.dumps(httpx.get(f"{rest[0]}/mesh", timeout=10).json()))
    elif command == "complete":
        import openai

        url, model, rounds, *prompts = rest
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def one(prompt: str) -> dict:
            reply = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            return {"prompt": prompt, "text": reply.choices[0].text, "tokens": reply.usage.completion_tokens}

        jobs = [p for _ in range(int(rounds)) for p in prompts]
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            print(json.dumps(list(pool.map(one, jobs))))
    elif command == "chat":
        import openai

        url, model, question = rest
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                               temperature=0, max_tokens=24)
        print(json.dumps({"text": reply.choices[0].message.content}))
    elif command == "refused":
        host, port = rest
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
            print(json.dumps(False))
        except ConnectionRefusedError:
            print(json.dumps(True))
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv[1:])
