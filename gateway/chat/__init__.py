"""The chat core every API runs through: plan a request once, run it on the mesh, read its turn back once.

What lives here: the request vocabulary (``request``: ``ChatRequest``, ``GenerationFields``) and the other
APIs' way into it (``translation``); the server's defaults (``defaults``); the plan (``plan``: sampling
settings from ``sampling``, the output grammar from ``grammar``, tools from ``tools``, the prompt from
``template``), built in one pass; running it (``generation``); reading the reply back (``turn``, with calls
from ``tool_output``) into turns and steps every API encodes; ``core.ChatCore`` ties them together.
May import: ``gateway.chat``, ``gateway.parsing``, ``gateway.http`` and ``stagemesh_core``; never an API's
package (``gateway.openai``, ``gateway.anthropic``, ...) nor ``gateway.mesh`` (the mesh is handed in as a
``generation.Generator``).
"""
