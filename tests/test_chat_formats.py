"""Every family's chat format (edge0/formats) through the real server and the official SDKs, on a
scripted model writing that format (tests/fixtures/formats, tests/scripted_engine.py): on Chat
Completions, Anthropic Messages and Responses, streamed and not,
- a request with tools gets exactly one call, get_weather with {"city": "Paris"}, the model's
  reasoning as reasoning, and no markup or later turn in the text;
- the conversation sent back with that call (its id as the client got it) and its result renders
  and is answered;
- a plain reply ends where its turn ends, whatever the model writes after it."""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from edge0.server.config import ServerConfig
from tests.fake_server import running_server
from tests.fixtures.formats import ANSWER, CITY, RESULT, WEATHER_TOOL, FormatCase, cases
from tests.scripted_engine import ScriptedEngine

CASES = cases()
APIS = ["chat", "messages", "responses"]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def served(request, tmp_path_factory):
    case = request.param
    engine = ScriptedEngine(case, tmp_path_factory.mktemp(case.name))
    with running_server(engine, ServerConfig(max_tokens=512)) as base:
        yield case, engine, base


class Reply:
    def __init__(self, text="", reasoning="", calls=()):
        self.text, self.reasoning, self.calls = text, reasoning, list(calls)  # calls: (id, name, arguments dict)


# -- each API, streamed and not ---------------------------------------------------------------


def chat(base: str, stream: bool, tools: bool, history: list | None = None) -> Reply:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": QUESTION}] + (history or [])
    kw = dict(model="m", messages=messages, temperature=0, tools=[WEATHER_TOOL] if tools else openai.NOT_GIVEN)
    if not stream:
        m = client.chat.completions.create(**kw).choices[0].message
        calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return Reply(m.content or "", getattr(m, "reasoning_content", None) or "", calls)
    text, reasoning, parts = "", "", {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            d = choice.delta
            text += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for c in d.tool_calls or []:
                p = parts.setdefault(c.index, {"id": None, "name": "", "args": ""})
                p["id"] = c.id or p["id"]
                p["name"] += (c.function.name or "") if c.function else ""
                p["args"] += (c.function.arguments or "") if c.function else ""
    return Reply(text, reasoning, [(p["id"], p["name"], json.loads(p["args"])) for p in parts.values()])


def chat_history(call_id: str) -> list:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": CITY})},
    }
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]


def messages(base: str, stream: bool, tools: bool, history: list | None = None) -> Reply:
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=30)
    kw = dict(
        model="m",
        max_tokens=512,
        messages=[{"role": "user", "content": QUESTION}] + (history or []),
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    if tools:
        f = WEATHER_TOOL["function"]
        kw["tools"] = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}]
    if stream:
        with client.messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kw)
    out = Reply()
    for block in message.content:
        if block.type == "text":
            out.text += block.text
        elif block.type == "thinking":
            out.reasoning += block.thinking
        elif block.type == "tool_use":
            out.calls.append((block.id, block.name, block.input))
    return out


def messages_history(call_id: str) -> list:
    return [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": CITY}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": RESULT}]},
    ]


def responses(base: str, stream: bool, tools: bool, history: list | None = None) -> Reply:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    kw = dict(model="m", input=[{"role": "user", "content": QUESTION}] + (history or []), temperature=0)
    if tools:
        f = WEATHER_TOOL["function"]
        kw["tools"] = [{"type": "function", "name": f["name"], "parameters": f["parameters"]}]
    if stream:
        done = [e for e in client.responses.create(**kw, stream=True) if e.type == "response.completed"]
        response = done[0].response
    else:
        response = client.responses.create(**kw)
    out = Reply()
    for item in response.output:
        if item.type == "message":
            out.text += "".join(c.text for c in item.content if c.type == "output_text")
        elif item.type == "reasoning":
            out.reasoning += "".join(c.text for c in item.content or item.summary)
        elif item.type == "function_call":
            out.calls.append((item.call_id, item.name, json.loads(item.arguments)))
    return out


def responses_history(call_id: str) -> list:
    return [
        {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": json.dumps({"city": CITY})},
        {"type": "function_call_output", "call_id": call_id, "output": RESULT},
    ]


SEND = {"chat": chat, "messages": messages, "responses": responses}
HISTORY = {"chat": chat_history, "messages": messages_history, "responses": responses_history}


def no_markup(text: str, engine) -> None:
    """No token of the format's markup, no special token and no later turn in `text`."""
    for token in [*engine.chat_format.markers(), *engine.case.special]:
        assert token not in text, (token, text)


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_a_call_comes_back_as_one_call_with_its_reasoning_and_the_conversation_continues(served, api, stream):
    case, engine, base = served
    got = SEND[api](base, stream, tools=True)
    assert [(name, args) for _, name, args in got.calls] == [("get_weather", {"city": CITY})], got.text
    no_markup(got.text, engine)
    assert got.text.strip() == ""
    assert got.reasoning.strip() == case.reasoning
    call_id = got.calls[0][0]
    if case.call_id:
        assert re.fullmatch(case.call_id, call_id), call_id
    after = SEND[api](base, stream, tools=True, history=HISTORY[api](call_id))  # rendered, then answered
    assert after.text.strip() == ANSWER and not after.calls
    no_markup(after.text, engine)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_a_plain_reply_ends_with_its_turn(served, api, stream):
    case, engine, base = served
    got = SEND[api](base, stream, tools=False)
    assert got.text.strip() == case.plain_text and not got.calls
    assert got.reasoning.strip() == case.plain_reasoning
    no_markup(got.text, engine)


def test_the_format_and_its_end_ids_are_found(served):
    case, engine, _ = served
    assert engine.chat_format.name == case.name
    ids = {engine.tokenizer.convert_tokens_to_ids(t) for t in (*case.config_eos, *case.generation_eos, case.eos)}
    assert ids <= set(engine.tokenizer.eos_token_ids)


PLAIN = FormatCase(
    name="plain",
    families="a template with no tool-call markup",
    template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    eos="<|im_end|>",
    special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    reasoning="",
    plain_reply="Hello there.<|im_end|><|im_start|>user\nmore",
)


@pytest.mark.parametrize("api", APIS)
def test_a_model_without_a_known_format_refuses_tools_by_name_and_still_chats(api, tmp_path):
    engine = ScriptedEngine(PLAIN, tmp_path)
    assert engine.chat_format.name == "plain" and not engine.chat_format.calls
    with running_server(engine, ServerConfig()) as base:
        with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as e:
            SEND[api](base, False, tools=True)
        message = str(e.value)
        assert "plain-fixture" in message and "(plain)" in message and "docs/clients.md" in message
        assert SEND[api](base, True, tools=False).text == "Hello there."
