"""OpenAI's API (and vLLM's extras) over the chat core: completions, chat, models, tokenize.

What lives here: the request bodies (``schemas``: the core's request with OpenAI's own fields), completion
prompts (``prompts``), the response and chunk shapes (``responses``) and logprobs in them (``logprobs``),
the serving (``serving``: the core's reply encoded as OpenAI's) and the routes (``routes``; vLLM's
``/tokenize``, ``/detokenize`` and ``/version`` in ``tokenize``).
May import: ``gateway.openai``, ``gateway.chat``, ``gateway.http`` and ``stagemesh_core``; never another
API's package.
"""
