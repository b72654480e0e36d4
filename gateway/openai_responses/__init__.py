"""OpenAI's Responses API (``POST /v1/responses``, ``/v1/responses/input_tokens``), stateless, over the chat path."""
