"""Pure readers of a model's output, for the chat core: no request, no HTTP, no mesh.

What lives here: incremental detokenization (``detokenizer``), stop strings across chunks
(``stop_strings``), reasoning told apart from the answer (``reasoning``), the tool-call formats and their
whole-text parser (``tool_parsers``) and their streaming parser (``tool_call_stream``). Each is fed text or
token ids and gives text or typed events back; fed any split of an input, each gives the same as fed it whole.
May import: ``gateway.parsing`` and the standard library only.
"""
