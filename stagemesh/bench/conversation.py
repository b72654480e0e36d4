"""The multi-turn chat workload of ``stagemesh bench serve``: what every turn of a conversation sends. Pure, no I/O.

The conversations of one level and round share one system prompt (the same for every endpoint); every turn of
a conversation adds a new user message and re-sends the whole history, the replies the server actually
streamed included, as chat clients do. What a server can reuse is therefore exactly what a real chat
deployment offers its prefix cache. ``system_prompt`` is the shared prompt, ``user_message`` one turn's new
message, ``turn_prompt`` the ``Prompt`` of one turn and ``Exchange`` one finished turn. Everything is
deterministic in its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagemesh.bench.types import Prompt
from stagemesh.bench.workload import Tokenizer, make_prompt, sized_text


@dataclass(frozen=True)
class Exchange:
    """One finished turn: what the user sent and what the assistant streamed back."""

    user: Prompt
    reply: str
    reply_tokens: int


def system_prompt(key: str, tokens: int, tokenizer: Tokenizer | None = None) -> Prompt:
    """The run's shared system prompt: a synthetic prompt (``workload.make_prompt``: filler words, then the
    counting instruction, so replies tend to run to ``max_tokens``) keyed by the level and round, so each run
    starts with nothing of it cached."""
    return make_prompt(f"{key}:system", tokens, tokenizer)


def user_message(key: str, conversation: int, turn: int, tokens: int, tokenizer: Tokenizer | None = None) -> Prompt:
    """Filler words only, drawn with (key, conversation, turn): conversations part within their first user
    words (two may share a word or two by chance), so what they share is the system prompt and the chat
    template's own tokens, not a block of their own histories."""
    return sized_text(f"{key}:conversation {conversation}:turn {turn}", tokens, tokenizer)


def turn_prompt(system: Prompt, exchanges: Sequence[Exchange], user: Prompt) -> Prompt:
    """The ``Prompt`` of one turn: messages system, then a (user, assistant) pair for every earlier exchange,
    then the new user message. Its ``tokens`` adds up the contents' token counts (the template adds a few per
    message; the server's ``usage`` wins when it reports one)."""
    messages: list[tuple[str, str]] = [("system", system.text)]
    tokens = system.tokens + user.tokens
    for exchange in exchanges:
        messages += [("user", exchange.user.text), ("assistant", exchange.reply)]
        tokens += exchange.user.tokens + exchange.reply_tokens
    messages.append(("user", user.text))
    return Prompt(user.text, tokens, system.tokens_source, tuple(messages))
