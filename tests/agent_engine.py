"""A scripted engine for driving the real coding-agent clients (Claude Code, Codex CLI, opencode)
through the real server, with replies written for an agent's tool loop: in the fake engine's
ChatML (tests/fake_engine.py), or in a family's chat format (FormatAgentEngine).

The reply follows the conversation the prompt was rendered from (its messages and tools):
- the last turn is a tool result -> "Tool result: LAST LINE" (Codex puts the command's output last);
- the last user turn says `run: CMD` and a tool takes a shell command (a `command` or `cmd`
  parameter: Claude Code's Bash, Codex's exec_command, opencode's bash) -> a call of that tool
  running CMD, every other required string parameter filled in;
- `call: NAME {JSON}` -> a call of the tool NAME with those arguments (a namespaced tool, say);
- anything else -> "Hello from edge0."
"""

from __future__ import annotations

import json
import re

from tests.fake_engine import FakeEngine
from tests.scripted_engine import ScriptedEngine

HELLO = "Hello from edge0."
TOOL_RESULT = "Tool result: "


def _shell_call(tools: list[dict], command: str) -> dict | None:
    for tool in tools:
        fn = tool.get("function", tool)
        props = (fn.get("parameters") or {}).get("properties") or {}
        key = next((k for k in ("command", "cmd") if k in props), None)
        if key is None:
            continue
        args = {key: ["bash", "-lc", command] if props[key].get("type") == "array" else command}
        for name in (fn.get("parameters") or {}).get("required") or []:
            if name not in args and props.get(name, {}).get("type") == "string":
                args[name] = "edge0 scripted call"
        return {"name": fn["name"], "arguments": args}
    return None


def decide(messages: list[dict], tools: list[dict]) -> dict | str:
    """The agent's next move (module docstring): a call {"name", "arguments"} or the reply's text."""
    turns = [m for m in messages if m.get("role") != "system"]
    if not turns:
        return HELLO
    last = turns[-1]
    content = last.get("content") or ""
    content = content if isinstance(content, str) else json.dumps(content)
    if last.get("role") == "tool":
        line = ([line for line in content.splitlines() if line.strip()] or [""])[-1]
        return TOOL_RESULT + line.strip()[:200]
    # opencode quotes the prompt of `opencode run`.
    if m := re.search(r'^"?run: (.+?)"?$', content, re.M):
        return _shell_call(tools, m.group(1).strip()) or HELLO
    if m := re.search(r'^"?call: (\S+) (\{.*\})"?$', content, re.M):
        return {"name": m.group(1), "arguments": json.loads(m.group(2))}
    return HELLO


class AgentEngine(FakeEngine):
    """FakeEngine with replies for an agent's tool loop (module docstring), in ChatML JSON calls."""

    model_id = "agent-fixture"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rendered: dict[tuple, tuple] = {}  # prompt ids -> (messages, tools) they were rendered from

    def chat_prompt(self, messages, tools=None, **template_kwargs) -> list[int]:
        ids = super().chat_prompt(messages, tools, **template_kwargs)
        self.rendered[tuple(ids)] = (messages, tools or [])
        return ids

    def reply(self, prompt: list[int]) -> str:
        move = decide(*self.rendered.get(tuple(prompt), ([], [])))
        return "<tool_call>\n" + json.dumps(move) + "\n</tool_call>" if isinstance(move, dict) else move


class FormatAgentEngine(ScriptedEngine):
    """The same agent writing the chat format of a format case (tests/fixtures/formats) that can
    write any call and text (`write_call`, `write_text`)."""

    def __init__(self, case, root, delay: float = 0.0, prefill_delay: float = 0.0):
        super().__init__(case, root)
        self.delay, self.prefill_delay = delay, prefill_delay
        self.model_id = f"agent-{case.name}"
        self.rendered: dict[tuple, tuple] = {}

    def chat_prompt(self, messages, tools=None, **template_kwargs) -> list[int]:
        ids = super().chat_prompt(messages, tools, **template_kwargs)
        self.rendered[tuple(ids)] = (messages, tools or [])
        return ids

    def reply(self, prompt: list[int]) -> str:
        move = decide(*self.rendered.get(tuple(prompt), ([], [])))
        if isinstance(move, dict):
            return self.case.write_call(move["name"], move["arguments"])
        return self.case.write_text(move)
