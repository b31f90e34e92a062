"""The coding agents as they really behave: their captured request bodies replayed
(tests/fixtures/clients, from scripts/capture_client_requests.py), the adaptations they need
(system turns inside a conversation, namespace and hosted tools, thinking without a reasoning
format), keep-alives while a long prefill runs, the setup lines `edge0 serve` prints, and the
real npm clients themselves in a loopback-only network namespace (tests/agent_clients.py;
skipped with the reason where they are not installed or namespaces cannot be made)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from edge0.formats import detect
from edge0.server.clients import agent_warnings
from edge0.server.config import ServerConfig
from edge0.server.conversation import place_system_turns, reminder, renders_mid_system
from tests.agent_clients import (
    LIBRARIES,
    PACKAGES,
    clients_dir,
    installed,
    libraries_installed,
    netns_problem,
    run_client,
)
from tests.agent_engine import HELLO, TOOL_RESULT, AgentEngine
from tests.fake_engine import IM_START, FakeEngine, FakeTokenizer
from tests.fake_server import running_server

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
BIG = ServerConfig(context_length=200_000, max_prompt_tokens=190_000)


def user(text):
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------ system turns


def _system(text):
    return {"role": "system", "content": text}


def _user(text):
    return {"role": "user", "content": text}


def test_leading_system_messages_join_and_later_ones_stay_or_fold():
    messages = [_system("a"), _system("b"), _user("u1"), _system("s1"), {"role": "assistant", "content": "x"}]
    messages += [_system("s2"), _user("u2")]
    kept, folded = place_system_turns(messages, mid_system=True)
    assert kept == [_system("a\n\nb"), _user("u1"), _system("s1"), messages[4], _system("s2"), _user("u2")]
    assert folded == 0
    moved, folded = place_system_turns(messages, mid_system=False)
    assert moved == [_system("a\n\nb"), _user("u1"), messages[4], _user(f"{reminder('s1')}\n\n{reminder('s2')}\n\nu2")]
    assert folded == 2
    # Claude Code's Agent tool: the system message is the last one; the user turn before takes it
    last, folded = place_system_turns([_user("say hello"), _system("agents")], mid_system=False)
    assert last == [_user(f"say hello\n\n{reminder('agents')}")] and folded == 1
    assert messages[3] == _system("s1")  # the caller's messages are not changed


def _renderer(template):
    def chat_prompt(messages):
        return list(template(messages).encode())

    return chat_prompt, lambda ids: bytes(ids).decode()


def test_the_probe_tells_templates_that_render_a_system_turn_from_those_that_raise_or_drop_it():
    def anywhere(messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    def alternating(messages):
        if any(m["role"] == "system" for m in messages[1:]):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        return anywhere(messages)

    def first_only(messages):
        return anywhere(messages[:1] + [m for m in messages[1:] if m["role"] != "system"])

    assert renders_mid_system(*_renderer(anywhere))
    assert not renders_mid_system(*_renderer(alternating))
    assert not renders_mid_system(*_renderer(first_only))


class _AlternatingTokenizer(FakeTokenizer):
    """A template that refuses a system turn after the first message (Mistral- and Gemma-style)."""

    def apply_chat_template(self, messages, tools=None, **kw):
        if any(m["role"] == "system" for m in messages[1:]):
            raise ValueError("Conversation roles must alternate user/assistant")
        return super().apply_chat_template(messages, tools=tools, **kw)


@pytest.mark.parametrize("mid_system", [True, False])
def test_anthropic_system_messages_inside_messages_reach_the_prompt(mid_system):
    engine = FakeEngine()
    if not mid_system:
        engine.tokenizer = _AlternatingTokenizer()
        engine.chat_format = detect(engine.tokenizer)
    messages = [*user("say hello"), {"role": "system", "content": [{"type": "text", "text": "Agent types: x"}]}]
    with running_server(engine, ServerConfig()) as base:
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
        reply = client.messages.create(model="m", max_tokens=64, messages=messages)
        adapted = httpx.get(base + "/v1/stats").json()["server"]["adapted"]
    prompt = engine.tokenizer.decode(engine.calls[-1].prompt)
    if mid_system:
        assert f"{IM_START}user\nsay hello" in prompt and f"{IM_START}system\nAgent types: x" in prompt
        assert adapted == {}
    else:
        assert f"{IM_START}user\nsay hello\n\n<system-reminder>\nAgent types: x\n</system-reminder>" in prompt
        assert adapted == {"system_turns_folded": 1}
    assert reply.content[0].text.startswith("Echo: ")


@pytest.mark.parametrize("role", ["tool", "developer", "function"])
def test_anthropic_other_roles_are_refused_in_anthropics_words(role):
    with running_server(FakeEngine(), ServerConfig()) as base:
        r = httpx.post(
            base + "/v1/messages",
            json={"model": "m", "max_tokens": 5, "messages": [*user("a"), {"role": role, "content": "b"}]},
        )
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    # Claude Code's fallback for servers that refuse a role looks for these words.
    assert f'Unexpected role "{role}"' in message and "input message role" in message


def test_a_conversation_of_system_messages_only_is_refused():
    with running_server(FakeEngine(), ServerConfig()) as base:
        r = httpx.post(
            base + "/v1/messages",
            json={"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "b"}]},
        )
    assert r.status_code == 400 and "no user message" in r.json()["error"]["message"]


# ------------------------------------------------------------------ Responses tools (Codex)

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}},
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Sub-agents.",
        "tools": [{"type": "function", "name": "wait_agent", "parameters": {"type": "object", "properties": {}}}],
    },
    {"type": "web_search", "external_web_access": False},
]


def test_namespace_tools_are_flattened_and_their_calls_come_back_with_the_namespace():
    engine = AgentEngine()
    with running_server(engine, BIG) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        r = client.responses.create(model="m", input="call: multi_agent_v1__wait_agent {}", tools=CODEX_TOOLS)
        call = r.output[0]
        assert (call.type, call.name, call.namespace, call.arguments) == (
            "function_call",
            "wait_agent",
            "multi_agent_v1",
            "{}",
        )
        # the call comes back in the next request's input, with its namespace; the model sees one name
        again = client.responses.create(
            model="m",
            tools=CODEX_TOOLS,
            input=[
                {"role": "user", "content": "call: multi_agent_v1__wait_agent {}"},
                {
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": "wait_agent",
                    "namespace": "multi_agent_v1",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": call.call_id, "output": "no agents"},
            ],
        )
        assert again.output_text == TOOL_RESULT + "no agents"
        stats = httpx.get(base + "/v1/stats").json()["server"]["adapted"]
    prompt = engine.tokenizer.decode(engine.calls[-1].prompt)
    assert '"name": "multi_agent_v1__wait_agent"' in prompt and "web_search" not in prompt
    assert '<tool_call>\n{"name": "multi_agent_v1__wait_agent"' in prompt  # the earlier call, by the same name
    assert stats == {"hosted_tools_left_out": 2}


@pytest.mark.parametrize(
    "tools,choice,words",
    [
        (CODEX_TOOLS, {"type": "web_search"}, "forces the tool 'web_search'"),
        ([{"type": "web_search"}], "required", "only hosted tools (web_search)"),
        ([CODEX_TOOLS[0], {"type": "namespace", "name": "n"}], "auto", "'tools.1.tools'"),
    ],
)
def test_tools_that_cannot_be_served_are_refused_by_name_or_index(tools, choice, words):
    with running_server(AgentEngine(), BIG) as base:
        r = httpx.post(base + "/v1/responses", json={"model": "m", "input": "x", "tools": tools, "tool_choice": choice})
    assert r.status_code == 400 and words in r.json()["error"]["message"]


# ------------------------------------------------------------------ the clients' captured requests


@pytest.mark.parametrize("client", sorted(PACKAGES))
def test_captured_client_requests_are_served(client):
    """Each request the real client sent during a tool round trip, replayed: 200, a complete
    stream, the tool round trip's reply, and nothing refused."""
    fixture = json.loads((FIXTURES / f"{client}.json").read_text())
    assert fixture["client"] == "@".join(PACKAGES[client])
    engine = AgentEngine()
    with running_server(engine, BIG) as base:
        for request in fixture["requests"]:
            body = request["body"]
            with httpx.stream("POST", base + request["path"], json=body, timeout=60) as r:
                text = r.read().decode()
                assert r.status_code == 200, text[:500]
            if body.get("stream"):
                last = {"/v1/messages": "event: message_stop", "/v1/responses": "event: response.completed"}
                assert last.get(request["path"], "data: [DONE]") in text
        counts = httpx.get(base + "/v1/stats").json()["server"]
    assert counts["completed"] == len(fixture["requests"]) and counts["failed"] == 0
    answers = [engine.reply(c.prompt) for c in engine.calls]
    assert any(a.startswith("<tool_call>") and "echo edge0-round-trip" in a for a in answers)  # the call
    assert TOOL_RESULT + "edge0-round-trip" in answers  # and its result, sent back
    if client == "claude":  # its Agent tool's system message became a system turn of the prompt
        prompt = engine.tokenizer.decode(engine.calls[1].prompt)
        assert f"{IM_START}system\nAvailable agent types" in prompt
    if client == "codex":  # namespaced tools flattened, web_search left out
        assert counts["adapted"]["hosted_tools_left_out"] == len(fixture["requests"])
        assert "multi_agent_v1__wait_agent" in engine.tokenizer.decode(engine.calls[0].prompt)


# ------------------------------------------------------------------ keep-alives


def test_keepalives_while_the_prefill_runs_leave_every_api_reply_unchanged():
    engine = FakeEngine(prefill_delay=0.01)  # ~0.4 s of prefill
    slow = ServerConfig(keepalive_s=0.05)
    with running_server(engine, slow) as base:
        claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
        kwargs = dict(model="m", max_tokens=32, messages=user("hello there"))
        events = list(claude.messages.create(**kwargs, stream=True))
        kinds = [e.type for e in events]
        first = kinds.index("content_block_start")
        assert kinds[0] == "message_start" and kinds[1:first] == ["message_delta"] * (first - 1) and first >= 3
        assert all(e.usage.output_tokens == 0 and e.delta.stop_reason is None for e in events[1:first])
        with claude.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        whole = claude.messages.create(**kwargs)
        assert [b.text for b in final.content] == [b.text for b in whole.content] == ["Echo: hello there"]
        assert final.stop_reason == whole.stop_reason == "end_turn"
        assert final.usage.output_tokens == whole.usage.output_tokens

        oai = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        # (each prompt differs from the one before: the fake engine's KV reuse would skip the prefill)
        with oai.responses.stream(model="m", input="hello again") as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_response()
        assert kinds.count("response.in_progress") >= 3 and final.output_text == "Echo: hello again"
        chunks = list(oai.chat.completions.create(model="m", messages=user("hi you"), stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Echo: hi you"
        empty = [c for c in chunks if c.choices[0].delta.content == "" and c.choices[0].delta.role is None]
        assert len(empty) >= 3 and all(c.choices[0].finish_reason is None for c in empty)
        texts = list(
            oai.completions.create(model="m", prompt="once more, with a longer prompt", max_tokens=8, stream=True)
        )
        assert sum(c.choices[0].text == "" for c in texts) >= 3 and "".join(c.choices[0].text for c in texts)


def test_the_node_sdks_stream_parsers_read_the_keepalives_without_error():
    """The openai node SDK and the AI SDK's OpenAI-compatible provider (opencode's) through a
    prefill with keep-alives: no error, and the text as without them."""
    if shutil.which("node") is None or not libraries_installed():
        pytest.skip(f"node or the pinned {sorted(LIBRARIES)} are not installed under $EDGE0_AGENT_CLIENTS")
    engine = FakeEngine(prefill_delay=0.01)
    with running_server(engine, ServerConfig(keepalive_s=0.05)) as base:
        script = Path(__file__).parent / "js" / "stream_keepalives.mjs"
        p = subprocess.run(["node", str(script), str(clients_dir()), base], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    assert got["openai"] == {"text": "Echo: hello from node", "chunks": got["openai"]["chunks"], "errors": []}
    assert got["ai"]["text"] == "Echo: hello from the ai sdk" and got["ai"]["errors"] == []
    assert got["openai"]["chunks"] > len("Echo: hello from node") + 2  # the keep-alive chunks were parsed too


@pytest.mark.slow  # litellm's import alone takes 9 s of the 2-core budget
def test_litellm_reads_the_keepalives_without_error(monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its import would fetch a price list otherwise
    litellm = pytest.importorskip("litellm")
    with running_server(FakeEngine(prefill_delay=0.01), ServerConfig(keepalive_s=0.05)) as base:
        chunks = list(
            litellm.completion(
                model="openai/m", api_base=base + "/v1", api_key="x", messages=user("hello from litellm"), stream=True
            )
        )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Echo: hello from litellm"


@pytest.mark.parametrize(
    "prefill_s,keepalive_s",
    [(2.0, 0.1), pytest.param(300.0, ServerConfig.keepalive_s, marks=pytest.mark.slow)],
    ids=["2s", "300s"],
)
def test_the_openai_sdks_stream_iterator_gets_an_event_every_keepalive_through_a_long_prefill(prefill_s, keepalive_s):
    """Agent CLIs' idle guards count the chunks the SDK parses (SSE comments never reach them):
    through the whole prefill, a parsed chunk at least every keepalive_s (plus scheduling slack),
    and the reply as without keep-alives."""
    prompt = user("a long prompt")
    engine = FakeEngine()
    n = len(engine.chat_prompt(prompt))
    engine.prefill_delay = prefill_s / n
    with running_server(engine, ServerConfig(keepalive_s=keepalive_s)) as base:
        oai = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=prefill_s + 60)
        start = time.monotonic()
        stamps, text = [start], ""
        for chunk in oai.chat.completions.create(model="m", messages=prompt, stream=True):
            stamps.append(time.monotonic())
            text += chunk.choices[0].delta.content or ""
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert stamps[-1] - start >= prefill_s and text == "Echo: a long prompt"
    assert max(gaps) < keepalive_s + max(0.5, keepalive_s / 5), max(gaps)


# ------------------------------------------------------------------ start-up


def test_startup_warns_when_agents_cannot_use_the_model():
    assert agent_warnings(True, 131072) == []
    no_tools, short = agent_warnings(False, 4096)
    assert "no tool-call format" in no_tools and "4096 tokens" in short and "16384" in short


# ------------------------------------------------------------------ the real clients


def _client_problem(client: str) -> str | None:
    if installed(client) is None:
        package, version = PACKAGES[client]
        return f"{package}@{version} is not installed under $EDGE0_AGENT_CLIENTS (.ci/run installs it)"
    return netns_problem()


# The chat format the agent writes: ChatML JSON calls (the fake engine), GLM's or gpt-oss's. The
# default run drives Claude Code on ChatML (15-30 s of node start-up each: the suite's 2-core budget);
# -m slow runs every client on every format.
FORMATS = [None, "glm47", "harmony"]
PAIRS = [(c, f) for c in sorted(PACKAGES) for f in FORMATS]
DEFAULT_PAIRS = {("claude", None)}


@pytest.mark.parametrize(
    "client,fmt",
    [pytest.param(c, f, marks=() if (c, f) in DEFAULT_PAIRS else pytest.mark.slow) for c, f in PAIRS],
    ids=[f"{c}-{f or 'chatml'}" for c, f in PAIRS],
)
def test_the_real_client_with_the_printed_setup_completes_a_tool_round_trip(client, fmt, tmp_path):
    if problem := _client_problem(client):
        pytest.skip(problem)
    result = run_client(client, "run: echo edge0-round-trip", tmp_path, **({"format": fmt} if fmt else {}))
    assert result["rc"] == 0, result["stderr"][-2000:]
    assert TOOL_RESULT + "edge0-round-trip" in result["stdout"]
    # the reply quotes the command's output, which only the request after the tool call carried
    assert result["generations"] >= 2


@pytest.mark.slow  # 16 s; the keep-alives themselves are checked in the default run (above)
def test_codex_with_a_stream_idle_timeout_shorter_than_the_prefill_gets_its_answer_first_time(tmp_path):
    """Codex aborts a stream that sends no SSE event for stream_idle_timeout_ms: the keep-alives
    carry it through a prefill three times longer, in one request."""
    if problem := _client_problem("codex"):
        pytest.skip(problem)
    idle = ["-c", "model_providers.edge0.stream_idle_timeout_ms=2000"]
    result = run_client("codex", "say hello", tmp_path, keepalive_s=0.5, extra=idle, prefill_delay=0.00015)
    assert result["rc"] == 0 and HELLO in result["stdout"], result["stderr"][-2000:]
    assert result["generations"] == 1 and result["wall_s"] > 6


def test_claude_codes_billing_line_does_not_break_the_shared_prefix():
    """Claude Code starts `system` with `x-anthropic-billing-header: cc_version=2.1.197.<suffix>`,
    a suffix that differs between its requests: left out, two requests share their whole prefix."""
    engine = FakeEngine()
    prompts = []
    with running_server(engine, ServerConfig()) as base:
        for suffix in ("d55", "a7b"):
            system = [
                {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=x;"},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            ]
            body = {"model": "m", "max_tokens": 8, "system": system, "messages": user("hello")}
            assert httpx.post(base + "/v1/messages", json=body).status_code == 200
            prompts.append(engine.tokenizer.decode(engine.calls[-1].prompt))
    assert prompts[0] == prompts[1] and "billing" not in prompts[0] and "You are Claude Code." in prompts[0]
    assert engine.calls[-1].prefill_tokens == 1  # the KV cache held all but the prompt's last token
