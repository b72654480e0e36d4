"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``)
over the chat core.

What lives here: the request bodies and the options Ollama defines (``protocol``), their translation into the
core's requests (``translate``), the turn encoded as Ollama's objects and NDJSON lines, and the served model
described (``serving``), the routes with the refusals of what stagemesh does otherwise (``routes``) and Ollama's
error shape ``{"error": "..."}`` (``errors``).
May import: ``gateway.ollama``, ``gateway.chat``, ``gateway.http`` and ``stagemesh_core``; never another API's
package.
"""
