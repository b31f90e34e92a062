"""`edge0 serve`'s command line (flags, limits, usage errors) and the server on the real engine
of a fixture store (prefill chunks that stop between them). tests/test_server.py covers the
protocol with the fake engine."""

from __future__ import annotations

import json

import openai
import pytest

from edge0.server.config import ServerConfig, model_context_length
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server
from tests.test_server import WEATHER, user


def _serve_main(monkeypatch, tmp_path, argv, config_json=None):
    """Run `edge0 serve` with a fake engine whose store config is `config_json`; returns what
    it would serve (no socket is opened)."""
    import edge0
    from edge0.cli import serve
    from edge0.server import app as server_app

    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": 4096} if config_json is None else config_json)
    )
    ran = {}
    monkeypatch.setattr(
        edge0, "load", lambda path=None, **options: ran.update(path=path, options=options) or FakeEngine(root=tmp_path)
    )
    monkeypatch.setattr(server_app, "run", lambda app, **kw: ran.update(app=app, **kw))
    assert serve.main(argv) == 0
    return ran


def test_serve_main_wires_flags_and_warns_on_a_public_host(monkeypatch, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="edge0.server"):
        ran = _serve_main(
            monkeypatch,
            tmp_path,
            [
                "--model",
                "m",
                "--host",
                "0.0.0.0",
                "--port",
                "9999",
                "--max-queue",
                "3",
                "--max-tokens",
                "100",
                "--default-max-tokens",
                "50",
                "--no-lora",
            ],
        )
    assert (ran["path"], ran["host"], ran["port"]) == ("m", "0.0.0.0", 9999)
    assert ran["options"]["lora"] is False and ran["options"]["prerouter"] is None
    config = ran["app"].state.config
    assert (config.max_queue, config.max_tokens, config.default_max_tokens) == (3, 100, 50)
    assert "reachable from other machines" in caplog.text and "without --api-key" in caplog.text


@pytest.mark.parametrize(
    "config_json,argv,expected",
    [
        ({"max_position_embeddings": 4096}, [], 4096),  # the bundled model's context
        ({"text_config": {"max_position_embeddings": 2048}}, [], 2048),  # a multimodal config
        ({"max_position_embeddings": 4096}, ["--max-prompt-tokens", "100"], 100),
        ({}, [], 32768),  # declares none: the old default, with a warning
    ],
)
def test_prompt_limit_defaults_to_the_models_context(monkeypatch, tmp_path, caplog, config_json, argv, expected):
    with caplog.at_level("WARNING", logger="edge0.server"):
        ran = _serve_main(monkeypatch, tmp_path, argv, config_json)
    assert ran["app"].state.config.max_prompt_tokens == expected
    assert ("declares no context length" in caplog.text) == (not config_json)


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-queue", "-1"],
        ["--port", "http"],
        ["--default-max-tokens", "9999", "--max-tokens", "100"],
        ["--served-model-name", " "],
        ["--max-tokens", "0"],
        ["--port", "70000"],
        ["--port", "-1"],
    ],
)
def test_serve_usage_errors_are_one_line_exit_2(capsys, argv):
    from edge0.cli import serve

    with pytest.raises(SystemExit) as e:
        serve.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("edge0 serve: error:")


def test_real_engine_on_a_fixture_store(store_for):
    """The same server around the real engine and a tiny random qwen3_moe store."""
    import edge0

    engine = edge0.load(store_for("qwen3_moe"))
    assert (
        model_context_length(engine.root)
        == json.loads((engine.root / "config.json").read_text())["max_position_embeddings"]
        > 0
    )
    with running_server(engine, ServerConfig()) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        kwargs = dict(model=engine.model_id, messages=user("hello world"), max_tokens=12, temperature=0)
        r = client.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
        text = r.choices[0].message.content
        if len(text) >= 4:  # a random model: stop on a piece of what it said
            cut = client.chat.completions.create(**kwargs, stop=[text[2:4]])
            assert cut.choices[0].message.content == text[: text.index(text[2:4])]
        r = client.chat.completions.create(**kwargs, tools=WEATHER)  # the fixture's template takes tools
        assert r.usage.prompt_tokens > len(engine.chat_prompt(user("hello world")))
        assert (
            client.completions.create(model=engine.model_id, prompt="Once upon", max_tokens=4).usage.completion_tokens
            >= 1
        )


def test_real_engine_stops_during_prefill_and_between_steps_and_stays_consistent(store_for):
    """should_stop: checked between the prefill's layers and chunks and between decode steps; a
    stop in prefill keeps only whole spans (none here), StepHooks.finish runs, and the next
    generation is right."""
    import edge0
    from edge0.engine.hooks import StepHooks

    class Recorder(StepHooks):
        def __init__(self):
            self.events = []

        def start(self):
            self.events.append("start")

        def finish(self):
            self.events.append("finish")

    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    engine.hooks = hooks = Recorder()
    prompt = [(7 * i) % 200 + 10 for i in range(1124)]
    expected = engine.generate(prompt, max_tokens=6).tokens

    checks = []
    engine.reset_cache()
    steps = list(
        engine.stream_generate(
            prompt, max_tokens=6, reuse_cache=True, should_stop=lambda: checks.append(1) or len(checks) >= 2
        )
    )
    assert steps == [] and len(checks) == 2  # stopped inside the first layer
    assert hooks.events[-2:] == ["start", "finish"]
    again = engine.generate(prompt, max_tokens=6, reuse_cache=True)
    assert again.stats["prefill_tokens"] == len(prompt)  # no span was complete: nothing kept
    assert again.tokens == expected

    cancellable = engine.generate(prompt + [3], max_tokens=6, should_stop=lambda: False)
    engine.reset_cache()
    assert cancellable.tokens == engine.generate(prompt + [3], max_tokens=6).tokens  # checks change nothing

    stop = []  # a stop between decode steps: the tokens so far, no final step
    steps = []
    for s in engine.stream_generate(prompt, max_tokens=6, should_stop=lambda: len(stop) > 0):
        steps.append(s)
        if len(steps) == 3:
            stop.append(1)
    assert [s.token for s in steps] == expected[:3] and all(s.finish_reason is None for s in steps)
    assert engine.generate(prompt, max_tokens=6, reuse_cache=True).tokens == expected


def test_serve_prints_each_clients_setup_and_wires_the_model_names(monkeypatch, tmp_path, caplog):
    with caplog.at_level("INFO", logger="edge0.server"):
        ran = _serve_main(
            monkeypatch,
            tmp_path,
            ["--port", "9001", "--api-key", "sk-secret", "--served-model-name", "coder", "--strict-model-name"],
        )
    config = ran["app"].state.config
    assert config.served_model_names == ("coder",) and config.strict_model_name
    assert config.context_length == 4096 and config.max_tokens is None and config.default_max_tokens == 4096
    lines = [r.getMessage() for r in caplog.records]
    claude = next(line for line in lines if line.startswith("Claude Code:"))
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:9001 " in claude and "ANTHROPIC_MODEL=coder" in claude
    codex = next(line for line in lines if line.startswith("Codex CLI:"))
    assert 'base_url="http://127.0.0.1:9001/v1", wire_api="responses", env_key="EDGE0_API_KEY"' in codex
    assert any(line.startswith("OpenAI SDK:") for line in lines)
    assert "sk-secret" not in caplog.text  # the key is never logged


def test_a_client_that_leaves_during_the_prefill_leaves_its_spans_cached_for_the_retry(store_for, monkeypatch):
    """Claude Code and Codex retry a request whose stream went idle: the retry resumes from the
    spans the abandoned prefill finished, and its usage says so."""
    import threading
    import time

    import httpx

    import edge0
    from edge0.backend import layerwise as blw

    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    engine.prefiller.span_tokens = 128
    spans, real = threading.Event(), blw.prefill_layerwise

    def slow_span(*args):  # 0.1 s per span: the client leaves after the second
        real(*args)
        time.sleep(0.1)
        if engine.prefiller.spans >= 1:
            spans.set()

    monkeypatch.setattr(blw, "prefill_layerwise", slow_span)
    text = " ".join(f"word{i % 97}" for i in range(300))
    body = {"model": "m", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": text}]}
    with running_server(engine, ServerConfig()) as base:
        with httpx.stream("POST", base + "/v1/messages", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            assert spans.wait(30)  # a span is done; the client goes
        deadline = time.monotonic() + 30
        while engine.generating and time.monotonic() < deadline:
            time.sleep(0.05)
        kept = len(engine.kv.newest.tokens)
        assert kept > 0 and kept % 128 == 0
        retry = httpx.post(base + "/v1/messages", json=body, timeout=60).json()
        assert retry["usage"]["cache_read_input_tokens"] == kept
        engine.reset_cache()
        cold = httpx.post(base + "/v1/messages", json=body, timeout=60).json()
        assert cold["usage"]["cache_read_input_tokens"] == 0 and cold["content"] == retry["content"]
        written = cold["usage"]["cache_creation_input_tokens"]  # every prefilled token, cached for the next
        assert written == retry["usage"]["cache_creation_input_tokens"] + kept and cold["usage"]["input_tokens"] == 0


def test_generated_control_tokens_are_not_in_the_text(store_for):
    """A model may sample <|im_start|> or <|endoftext|>: the tokens count, their text is not shown
    (reasoning and tool-call markers, which the server parses, stay)."""
    import edge0
    from tests.fixtures import tokenizer as tok

    engine = edge0.load(store_for("qwen3_moe"), prerouter=False)
    control = {tok.token_id(t) for t in ("<|im_start|>", "<|endoftext|>")}
    assert control <= engine.control_ids and tok.token_id("<tool_call>") not in engine.control_ids
    # <|endoftext|> is an end id of the fixture's generation_config.json, as in Qwen3's: it ends the reply
    assert tok.token_id("<|endoftext|>") in engine.tokenizer.eos_token_ids
    bias = {str(tok.token_id("<|im_start|>")): 100}  # every token is <|im_start|>
    with running_server(engine, ServerConfig()) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="m", messages=user("hi"), max_tokens=5, logit_bias=bias)
        assert r.choices[0].message.content == "" and r.usage.completion_tokens == 5
        streamed = client.chat.completions.create(
            model="m", messages=user("hi"), max_tokens=5, logit_bias=bias, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ""
    markup = engine.generate("hi", max_tokens=3, logits_processors=[_force(tok.token_id("<tool_call>"))])
    assert markup.text == "<tool_call>" * 3


def _force(token: int):
    from edge0.backend.logits import only_token

    return lambda generated, row: only_token(row, token)
