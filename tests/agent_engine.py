"""A scripted engine for driving the real coding-agent clients (Claude Code, Codex CLI, opencode)
through the real server: the fake engine's tokenizer and chat template (tests/fake_engine.py),
with replies written for an agent's tool loop.

The reply reads the rendered prompt back (ChatML, tools as JSON lines in `<tools>`):
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

from tests.fake_engine import IM_END, IM_START, FakeEngine

HELLO = "Hello from edge0."
TOOL_RESULT = "Tool result: "


def _turns(text: str) -> list[tuple[str, str]]:
    """(role, content) of each ChatML turn of a rendered prompt, the open assistant turn left out."""
    out = []
    for block in text.split(IM_START)[1:]:
        role, _, content = block.partition("\n")
        if content.endswith(f"{IM_END}\n"):
            out.append((role, content.removesuffix(f"{IM_END}\n")))
    return out


def _tools(text: str) -> list[dict]:
    m = re.search(r"<tools>\n(.*?)\n</tools>", text, re.S)
    return [json.loads(line) for line in m.group(1).splitlines()] if m else []


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


class AgentEngine(FakeEngine):
    """FakeEngine with replies for an agent's tool loop (module docstring)."""

    model_id = "agent-fixture"

    def reply(self, prompt: list[int]) -> str:
        text = self.tokenizer.decode(prompt)
        turns = [t for t in _turns(text) if t[0] != "system"]
        if not turns:
            return HELLO
        role, content = turns[-1]
        if m := re.search(r"<tool_response>\n(.*?)\n</tool_response>", content, re.S):
            last = ([line for line in m.group(1).splitlines() if line.strip()] or [""])[-1]
            return TOOL_RESULT + last.strip()[:200]
        call = None
        # opencode quotes the prompt of `opencode run`.
        if m := re.search(r'^"?run: (.+?)"?$', content, re.M):
            call = _shell_call(_tools(text), m.group(1).strip())
        elif m := re.search(r'^"?call: (\S+) (\{.*\})"?$', content, re.M):
            call = {"name": m.group(1), "arguments": json.loads(m.group(2))}
        if call is not None:
            return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
        return HELLO
