"""The OpenAI SDK against the gateway on uvicorn, over a real grpc.aio fake stage."""

from __future__ import annotations

from .conftest import MODEL

CHAT = [{"role": "user", "content": "Say hello"}]


def test_chat_non_streaming(client, stage, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == "Hello there!"
    assert choice.finish_reason == "stop"
    # The prompt is the chat template's rendering with the generation prompt, as sent to the stage.
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    sent = list(stage.requests[0].prompt_token_ids)
    assert sent == tokenizer.encode(text, add_special_tokens=False)
    assert list(stage.requests[0].stop_token_ids) == [2]
    # EOS counts as generated, never shows as text.
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(sent), 4)
    assert r.usage.total_tokens == len(sent) + 4
    assert stage.requests[0].max_tokens == 2048 - len(sent)  # default: the room left


def test_chat_streaming_with_usage(client, stage):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there!"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completion_string_and_token_ids(client, stage):
    r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2)
    assert r.object == "text_completion"
    assert r.choices[0].text == "Hello there" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 2
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=10)
    assert list(stage.requests[-1].prompt_token_ids) == [1, 2, 3, 4]
    assert r.usage.prompt_tokens == 4 and r.choices[0].text == "Hello there!"


def test_completion_streaming_and_batch_of_prompts(client, stage):
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello there!"
    assert chunks[-1].usage.completion_tokens == 4
    r = client.completions.create(model=MODEL, prompt=["a", "b c"], max_tokens=1)
    assert [c.index for c in r.choices] == [0, 1] and all(c.text == "Hello" for c in r.choices)


def test_multibyte_text_streams_whole_characters(client, stage, tokenizer):
    text = "héllo 世界 🙂 ok"
    stage.script.reply_ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="x", stream=True)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_stop_string_cuts_text_and_frees_the_stage(client, stage, tokenizer):
    stage.reset(reply_ids=tokenizer.encode(" one two three four", add_special_tokens=False), end_with_eos=False,
                delay_s=0.005)
    r = client.completions.create(model=MODEL, prompt="count", max_tokens=1000, stop=["thr", "zzz"])
    assert r.choices[0].text == " one two " and r.choices[0].finish_reason == "stop"
    from .fakes import wait_for

    assert wait_for(lambda: stage.requests[0].request_id in stage.cancelled)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1000, stop="two",
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " one "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_with_seeds(client, stage):
    r = client.completions.create(model=MODEL, prompt="x", n=2, seed=7, temperature=0.8, max_tokens=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert sorted(req.sampling.seed for req in stage.requests) == [7, 8]
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 1  # the prompt counts once
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, n=2, stream=True))
    for i in (0, 1):
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) == "Hello there!"


def test_sampling_fields_reach_the_stage(client, stage):
    client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0.5, top_p=0.9, seed=3,
                                   max_completion_tokens=5, extra_body={"top_k": 20}, user="someone")
    req = stage.requests[-1]
    assert abs(req.sampling.temperature - 0.5) < 1e-6 and abs(req.sampling.top_p - 0.9) < 1e-6
    assert req.sampling.top_k == 20 and req.sampling.seed == 3 and req.max_tokens == 5
