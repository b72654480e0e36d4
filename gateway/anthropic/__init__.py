"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the chat core.

What lives here: the request bodies (``protocol``), their translation into the core's chat request
(``translate``), the core's turn encoded as a ``message`` or Anthropic's events (``serving``), the routes
(``routes``) and Anthropic's error envelope (``errors``).
May import: ``gateway.anthropic``, ``gateway.chat``, ``gateway.http`` and ``stagemesh_core``; never another
API's package.
"""
