"""OpenAI's Responses API (``POST /v1/responses``, ``/v1/responses/input_tokens``), stateless, over the chat core.

What lives here: the request bodies (``protocol``), their translation into the core's chat request
(``translate``), the core's turn encoded as a ``response`` or its numbered events (``serving``) and the routes
(``routes``).
May import: ``gateway.openai_responses``, ``gateway.chat``, ``gateway.http`` and ``stagemesh_core``; never
another API's package (not ``gateway.openai`` either: only the core is shared).
"""
