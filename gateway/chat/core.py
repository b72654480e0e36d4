"""The chat core every API runs through: plan a request, run it on the mesh, read the reply back.

Contract: ``ChatCore(server, client, observer)`` holds what every request shares: the ``ChatServer``, the mesh
(a ``Generator``: the replica client) and the observer of tokens and usage (the gateway's metrics).
``plan(req, arrived)`` is ``gateway.chat.plan.plan_chat``. ``run_chat(plan, request_id, affinity=...,
split_reasoning=..., fill_context=...)`` checks the plan's token budget (a 400 before any call), starts its
choices and returns their ``Reply`` (``gateway.chat.turn``); ``affinity`` is a client's cache key, which the
replica choice follows; ``fill_context`` (an API whose budget may run past the context, Anthropic's) makes a
budget beyond the context the room left, the turn then ending with stop ``context`` where the context ran out.
``run_prompts(prompts, settings, request_id, arrived)`` does the same for completion prompts, read as plain
text. Nothing runs until the reply is read; closing it cancels every call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from .generation import Generator, RunContext, TokenObserver, choice_jobs, run_choices
from .plan import ChatPlan, ChatServer, Reading, plan_chat
from .request import ChatRequest
from .sampling import SamplingSettings
from .turn import Reply, UsageObserver


class Observer(TokenObserver, UsageObserver, Protocol):
    pass


class ChatCore:
    def __init__(self, server: ChatServer, client: Generator, observer: Observer) -> None:
        self.server = server
        self._client = client
        self._observer = observer

    def plan(self, req: ChatRequest, arrived: float | None = None) -> ChatPlan:
        return plan_chat(req, self.server, time.monotonic() if arrived is None else arrived)

    def run_chat(self, plan: ChatPlan, request_id: str, *, affinity: str | None = None,
                 split_reasoning: bool = False, fill_context: bool = False) -> Reply:
        return self._run([plan.prompt], plan.settings, "messages", plan.arrived, request_id, affinity, plan.reading,
                         split_reasoning, fill_context)

    def run_prompts(self, prompts: Sequence[tuple[int, ...]], settings: SamplingSettings, request_id: str,
                    arrived: float, fill_context: bool = False) -> Reply:
        return self._run(prompts, settings, "prompt", arrived, request_id, None, Reading(), False, fill_context)

    def _run(self, prompts: Sequence[tuple[int, ...]], settings: SamplingSettings, prompt_param: str, arrived: float,
             request_id: str, affinity: str | None, reading: Reading, split_reasoning: bool,
             fill_context: bool) -> Reply:
        jobs = choice_jobs(prompts, settings, self.server.max_model_len, prompt_param, fill_context)
        ctx = RunContext(client=self._client, tokenizer=self.server.tokenizer,
                         stop_token_ids=settings.stop_token_ids(self.server.eos_token_ids), stop=settings.stop,
                         request_id=request_id, observer=self._observer, arrived=arrived,
                         skip_special_tokens=settings.skip_special_tokens,
                         include_stop_str_in_output=settings.include_stop_str_in_output, affinity=affinity)
        return Reply(jobs, run_choices(jobs, ctx), reading, self._observer, split_reasoning=split_reasoning)
