"""Structured outputs, log-probs and a Claude-Code-shaped request on the real engine of a tiny
random fixture model: the grammar's mask is applied before sampling (greedy and sampled), every
output parses and validates with `jsonschema`, forced tool calls follow their tool's schema, and
the reported log-probs are the engine's own."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import numpy as np
import openai
import pytest

from edge0.server.config import ServerConfig
from edge0.server.grammar import Constraint, Grammars, strict_schema
from tests.fake_server import running_server
from tests.fixtures.schemas import SCHEMAS

ASK = [{"role": "user", "content": "Answer in JSON."}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(store_for):
    import edge0

    return edge0.load(store_for("qwen3_moe"), prerouter=False)


@pytest.fixture(scope="module")
def url(engine):
    with running_server(engine, ServerConfig(max_tokens=1200)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def schema_format(name, schema, strict=None):
    spec = {"name": name, "schema": schema, **({} if strict is None else {"strict": strict})}
    return {"type": "json_schema", "json_schema": spec}


def sampled(client, samples: int, schemas=SCHEMAS) -> dict:
    """`samples` completions at temperature 1 per schema (and json_object): name -> outputs."""
    out = {}
    for name, (schema, _) in schemas.items():
        out[name] = [
            client.chat.completions.create(
                model="any", messages=ASK, temperature=1, seed=i, response_format=schema_format(name, schema)
            )
            for i in range(samples)
        ]
    out["json_object"] = [
        client.chat.completions.create(
            model="any", messages=ASK, temperature=1, seed=i, response_format={"type": "json_object"}
        )
        for i in range(samples)
    ]
    return out


def check_outputs(outputs: dict) -> None:
    for name, replies in outputs.items():
        schema = SCHEMAS[name][0] if name in SCHEMAS else {"type": "object"}
        for r in replies:
            assert r.choices[0].finish_reason == "stop", (name, r.choices[0].message.content[-80:])
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)


# One schema of each kind (patterns, bounded numbers, nested objects, arrays of objects, enums).
QUICK = {name: SCHEMAS[name] for name in ("person", "point", "user", "order", "event")}


@pytest.mark.slow  # in the default suite's time budget: the greedy schema tests stay
def test_schemas_and_json_object_sampled_at_temperature_1(client):
    """Acceptance 2 in brief: one completion each of five schemas and json_object; the slow test
    below runs all ten schemas and json_object 20 times each."""
    check_outputs(sampled(client, 1, QUICK))


@pytest.mark.slow
def test_every_schema_twenty_completions_at_temperature_1(client, capsys):
    outputs = sampled(client, 20)
    check_outputs(outputs)
    tokens = sum(r.usage.completion_tokens for replies in outputs.values() for r in replies)
    with capsys.disabled():
        print(f"\n{sum(map(len, outputs.values()))} completions, {tokens} tokens, all valid")


def test_greedy_picks_the_best_allowed_token_each_step(engine):
    """The mask is applied before sampling: greedy under a grammar takes, at every step, the
    most likely token among those the grammar allows (checked against the model's own
    log-probs and an independent matcher)."""
    import llguidance
    import llguidance.numpy as llnp

    grammars = Grammars(engine.tokenizer)
    schema = SCHEMAS["order"][0]
    prompt = engine.chat_prompt(ASK)
    steps = list(
        engine.stream_generate(
            prompt, max_tokens=200, logits_processors=[grammars.processor(Constraint(schema=schema))]
        )
    )
    assert steps[-1].finish_reason == "stop"
    tokens = [s.token for s in steps]
    rows = engine.decode_logits(prompt + tokens[:-1])[len(prompt) - 1 :]
    matcher = llguidance.LLMatcher(grammars.ll_tokenizer(), grammars.grammar(Constraint(schema=schema)))
    mask = llnp.allocate_token_bitmask(1, grammars.ll_tokenizer().vocab_size)
    for token, row in zip(tokens, rows):
        llnp.fill_next_token_bitmask(matcher, mask)
        allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: len(row)].astype(bool)
        assert allowed[token] and row[token] == row[allowed].max()
        assert matcher.consume_token(token)
    jsonschema.validate(json.loads(engine.tokenizer.decode(tokens[:-1])), schema)
    assert not allowed.all()  # the grammar did restrict


def test_forced_tool_calls_follow_the_tools_schema(client, url):
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", **SCHEMAS["color"][0]}}},
    ]
    for choice, seed in [({"type": "function", "function": {"name": "get_weather"}}, 0), ("required", 1)]:
        r = client.chat.completions.create(
            model="any", messages=ASK, tools=tools, tool_choice=choice, temperature=1, seed=seed
        )
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        schema = WEATHER if call.function.name == "get_weather" else SCHEMAS["color"][0]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    resp = client.responses.create(
        model="any",
        input="weather?",
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
        tool_choice="required",
        temperature=1,
    )
    (call,) = [o for o in resp.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    m = claude.messages.create(
        model="claude-haiku-4-5",
        max_tokens=300,
        messages=ASK,
        tools=[{"name": "get_weather", "input_schema": WEATHER}],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)


def test_responses_text_format_and_strict(client):
    open_schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
    }
    r = client.responses.create(
        model="any",
        input="json",
        temperature=1,
        text={"format": {"type": "json_schema", "name": "a", "schema": open_schema, "strict": True}},
    )
    value = json.loads(r.output_text)
    assert set(value) == {"a"} and 0 <= value["a"] <= 9  # strict: no undeclared properties
    assert r.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.responses.create(
            model="any",
            input="json",
            text={"format": {"type": "json_schema", "name": "u", "schema": {"type": "array", "uniqueItems": True}}},
        )


def _tokens_and_rows(engine, prompt, **kwargs):
    """The engine's own generation for `prompt` and the log-probs of every position it decoded."""
    engine.reset_cache()
    result = engine.generate(prompt, **kwargs)
    rows = engine.decode_logits(prompt + result.tokens[:-1])[len(prompt) - 1 :]
    eos = set(engine.tokenizer.eos_token_ids)
    if result.finish_reason == "stop" and result.tokens[-1] in eos:
        return result.tokens[:-1], rows[:-1]  # the EOS token is not reported
    return result.tokens, rows


def test_logprobs_are_the_engines_own(client, engine):
    """Acceptance 3: greedy and sampled, streamed and not, Chat Completions and Completions."""
    grammars = Grammars(engine.tokenizer)
    for temperature, seed in [(0, None), (0.8, 5)]:
        kwargs = dict(model="any", messages=ASK, max_tokens=10, temperature=temperature, seed=seed)
        tokens, rows = _tokens_and_rows(
            engine, engine.chat_prompt(ASK), max_tokens=10, temperature=temperature, seed=seed
        )
        whole = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=5).choices[0].logprobs.content
        chunks = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=5, stream=True)
        streamed = [
            c
            for chunk in chunks
            if chunk.choices and chunk.choices[0].logprobs
            for c in chunk.choices[0].logprobs.content
        ]
        for got in (whole, streamed):
            assert [bytes(c.bytes) for c in got] == [grammars.token_bytes(t) for t in tokens]
            assert np.allclose([c.logprob for c in got], [row[t] for t, row in zip(tokens, rows)], atol=1e-5, rtol=0)
            for c, row in zip(got, rows):
                tops = [t.logprob for t in c.top_logprobs]
                assert tops == sorted(tops, reverse=True) and np.allclose(
                    tops, np.sort(row)[::-1][:5], atol=1e-5, rtol=0
                )
                assert c.logprob <= tops[0] + 1e-6 and (temperature or c.logprob == tops[0])
        # Responses: the output text's tokens, in the part and in the stream's deltas
        asked = dict(model="any", input=ASK, max_output_tokens=10, temperature=temperature or 0.0)
        asked.update(include=["message.output_text.logprobs"], top_logprobs=5)
        if seed is None:
            part = client.responses.create(**asked).output[0].content[0]
            deltas = [
                lp
                for e in client.responses.create(**asked, stream=True)
                if e.type == "response.output_text.delta"
                for lp in e.logprobs
            ]
            assert len(part.logprobs) == len(deltas) >= len(tokens) - 1  # an end token has no text to carry it
            assert [bytes(c.bytes) for c in part.logprobs] == [grammars.token_bytes(t) for t in tokens][: len(deltas)]
            for got in (part.logprobs, deltas):
                assert np.allclose([c.logprob for c in got], [row[t] for t, row in zip(tokens, rows)][: len(got)])
                assert all(len(c.top_logprobs) == 5 and c.logprob == c.top_logprobs[0].logprob for c in got)
    tokens, rows = _tokens_and_rows(engine, engine.encode("Once upon a time"), max_tokens=8)
    lp = (
        client.completions.create(model="any", prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=3)
        .choices[0]
        .logprobs
    )
    assert np.allclose(lp.token_logprobs, [row[t] for t, row in zip(tokens, rows)], atol=1e-5, rtol=0)
    assert all(list(d.values()) == sorted(d.values(), reverse=True) for d in lp.top_logprobs)


def test_top_k_samples_among_the_k_most_likely(engine):
    steps = list(
        engine.stream_generate(
            engine.chat_prompt(ASK), max_tokens=30, temperature=1, seed=3, top_k=2, logprobs=2, ignore_eos=True
        )
    )
    assert all(s.token in [t for t, _ in s.top_logprobs] for s in steps)
    assert any(s.token != s.top_logprobs[0][0] for s in steps)  # sampled, not greedy


def test_logit_bias_changes_what_is_sampled(client, engine):
    target = engine.tokenizer.encode("e", add_special_tokens=False)[0]
    r = client.chat.completions.create(
        model="any", messages=ASK, max_tokens=6, temperature=0, logit_bias={str(target): 100}
    )
    assert r.choices[0].message.content == "e" * 6
    engine.reset_cache()
    first = engine.generate(engine.chat_prompt(ASK), max_tokens=1).tokens[0]  # greedy's first token, then banned
    again = client.chat.completions.create(
        model="any", messages=ASK, max_tokens=1, temperature=0, logprobs=True, logit_bias={str(first): -100}
    )
    assert bytes(again.choices[0].logprobs.content[0].bytes) != Grammars(engine.tokenizer).token_bytes(first)


@pytest.fixture(scope="module")
def thinking_engine(store_for):
    """The fixture model with a Qwen3-shaped template: tools and reasoning."""
    import edge0

    return edge0.load(store_for("qwen3_moe", thinking=True), prerouter=False)


def test_thinking_budget_ends_the_block(thinking_engine):
    from edge0.server.reasoning import budget

    engine = thinking_engine
    end = engine.tokenizer.encode("</think>", add_special_tokens=False)[0]
    limit = budget(engine.chat_format, engine.tokenizer, 3, inside=True)  # as if the prompt opened the block
    steps = list(
        engine.stream_generate(engine.chat_prompt(ASK), max_tokens=6, temperature=1, seed=0, logits_processors=[limit])
    )
    tokens = [s.token for s in steps]
    assert end in tokens[:4] and (limit.forced == 1) == (end not in tokens[:3])


def test_a_claude_code_shaped_request_streams(thinking_engine):
    """Acceptance 1: the official client, an unknown model name, max_tokens 32000, system blocks
    with cache_control, metadata, thinking, beta headers and ?beta=true, three tools with
    JSON-schema inputs, on a fixture whose template has tools and thinking."""
    engine = thinking_engine
    assert engine.tokenizer.has_thinking and engine.tokenizer.has_tool_calling
    schema = "http://json-schema.org/draft-07/schema#"
    tools = [
        {
            "name": "Bash",
            "description": "Run a shell command",
            "input_schema": {
                "$schema": schema,
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                "required": ["command"],
                "additionalProperties": False,
            },
        },
        {
            "name": "Read",
            "description": "Read a file",
            "input_schema": {
                "$schema": schema,
                "type": "object",
                "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer", "exclusiveMinimum": 0}},
                "required": ["file_path"],
                "additionalProperties": False,
            },
        },
        {
            "name": "TodoWrite",
            "description": "Update the todo list",
            "input_schema": {
                "$schema": schema,
                "type": "object",
                "properties": {
                    "todos": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"content": {"type": "string"}, "status": {"enum": ["pending", "completed"]}},
                            "required": ["content", "status"],
                        },
                    }
                },
                "required": ["todos"],
            },
        },
    ]
    request = dict(
        model="claude-sonnet-4-5-20250929",
        max_tokens=32000,
        system=[
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello world", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        tools=tools,
        metadata={"user_id": "user_abc_account_def_session_123"},
        thinking={"type": "enabled", "budget_tokens": 31999},
        extra_headers={
            "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
            "anthropic-version": "2023-06-01",
        },
        extra_query={"beta": "true"},
    )
    with running_server(engine, ServerConfig(max_tokens=24)) as base:  # --max-tokens keeps the random model short
        client = anthropic.Anthropic(base_url=base, api_key="sk-anything", max_retries=0, timeout=120)
        with client.messages.stream(**request) as stream:
            events = list(stream)
            final = stream.get_final_message()
        counted = client.messages.count_tokens(
            **{k: request[k] for k in ("model", "system", "messages", "tools", "thinking")}
        )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    starts = [e.index for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == stops == list(range(len(final.content)))
    # sampled at the client's temperature 1: an end of sequence first (p ~ 0.002 here) opens no block
    assert final.content or (final.stop_reason == "end_turn" and final.usage.output_tokens <= 1)
    assert final.model == engine.model_id and final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert final.usage.output_tokens <= 24
    u = final.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted.input_tokens
    # Thinking on reaches the template: no empty <think></think> block in the prompt.
    off = engine.chat_prompt([{"role": "user", "content": "x"}], enable_thinking=False)
    on = engine.chat_prompt([{"role": "user", "content": "x"}], enable_thinking=True)
    assert len(off) > len(on) and engine.tokenizer.decode(off[len(on) :]) == "<think>\n\n</think>\n\n"


def test_strict_mode_closes_object_schemas_and_leaves_data_alone():
    """strict: every object subschema gets additionalProperties false; values under const, enum,
    default and examples are data, and a property named "properties" is a property."""
    schema = {
        "type": "object",
        "properties": {
            "x": {"const": {"type": "object"}, "default": {"properties": {}}},
            "properties": {"type": "object", "properties": {"a": {"type": "string"}}},
            "l": {"type": "array", "items": {"type": "object"}},
        },
        "$defs": {"D": {"properties": {}}},
        "anyOf": [{"type": "object", "additionalProperties": True}],
    }
    got = strict_schema(schema)
    assert got["additionalProperties"] is False
    assert got["properties"]["x"] == schema["properties"]["x"]  # untouched data
    assert set(got["properties"]) == {"x", "properties", "l"}
    assert got["properties"]["properties"]["additionalProperties"] is False
    assert got["properties"]["l"]["items"]["additionalProperties"] is False
    assert got["$defs"]["D"]["additionalProperties"] is False
    assert got["anyOf"][0]["additionalProperties"] is True  # what a schema says stays
