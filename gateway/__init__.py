"""stagemesh gateway: the HTTP APIs in front of the stage mesh, one folder per API over one chat core.

``gateway.app.create_app(GatewayConfig(...), mesh=..., tokenizer=..., eos_token_ids=...)`` builds the
FastAPI app (``gateway.config`` holds its settings). The layers, each importing only those below it:
- the APIs, each a thin translation of its requests and responses that never imports another API:
  ``gateway.openai`` (completions, chat, models, tokenize), ``gateway.anthropic`` (Messages),
  ``gateway.openai_responses`` (Responses). A fourth API (Ollama's, say) goes in a folder of its own beside
  them: its request translated into ``gateway.chat.request.ChatRequest``, its answer encoded from
  ``gateway.chat.turn``'s turns and steps, its router included by ``gateway.app``.
- the core, ``gateway.chat``: a request planned once, run on the mesh, its turn read back once; over
  ``gateway.parsing``, pure readers of the model's output (detokenizer, stop strings, reasoning, tool calls).
- the plumbing, importing neither: ``gateway.http`` (errors, keys, limits, SSE, metrics, dashboard, OpenAPI)
  and ``gateway.mesh`` (the entry stages' gRPC client, replica choice, shared streams).
"""
