"""The gateway's HTTP plumbing, shared by every API and knowing none of them.

What lives here: the error envelope and its handlers (``errors``), API keys (``api_keys``, ``auth``), the
body limit, in-flight caps and CORS (``limits``), cancelling work when a client leaves (``cancellation``),
server-sent events (``sse``), the request models' documented schema (``schema``) and the OpenAPI document
(``openapi``), the Prometheus metrics and their last-minute windows (``metrics``, ``recent``), and the
dashboard with its live document (``dashboard``, ``live``; its page is ``gateway/static/``).
May import: ``gateway.http`` and ``stagemesh_core``; never the core (``gateway.chat``, ``gateway.parsing``),
an API's package, nor ``gateway.mesh``.
"""
