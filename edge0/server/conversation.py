"""System text between the turns of a conversation, made fit for the model's chat template.

Agents put system text inside the conversation: Claude Code's Agent tool sends a `{"role":
"system"}` message inside Anthropic `messages`, Codex sends `developer` input items. Chat
templates differ: most read only `messages[0]` as the system prompt, some render a system turn
anywhere (Qwen3), others raise or drop it silently. So leading system messages join into one,
and a later one stays a system turn only where the template renders one mid-conversation
(probed once per tokenizer); otherwise it is folded into the next user turn (the previous one
when none follows) as a `<system-reminder>`, which is what Claude Code itself does for a server
that refuses the role.
"""

from __future__ import annotations

import logging

log = logging.getLogger("edge0.server")

_PROBE = "zqxv probe turn"


def renders_mid_system(chat_prompt, decode) -> bool:
    """Whether the chat template renders a system message after the first user turn (it neither
    raises nor drops it). `chat_prompt(messages) -> token ids`, `decode(ids) -> text`."""
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hello."},
        {"role": "system", "content": _PROBE},
        {"role": "user", "content": "Go on."},
    ]
    try:
        text = decode(chat_prompt(messages))
    except Exception:  # templates that enforce user/assistant alternation raise (Jinja's raise_exception)
        return False
    return _PROBE in text


def reminder(text: str) -> str:
    return f"<system-reminder>\n{text}\n</system-reminder>"


def place_system_turns(messages: list[dict], mid_system: bool) -> tuple[list[dict], int]:
    """`messages` (chat-template dicts) with the leading system messages joined and later ones kept
    (`mid_system`) or folded into a user turn; also how many were folded."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    out = [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:lead] if m["content"])}]
    out = out if lead else []
    rest = [dict(m) for m in messages[lead:]]
    if mid_system or all(m["role"] != "system" for m in rest):
        return out + rest, 0
    folded, pending = 0, []
    kept: list[dict] = []
    for m in rest:
        if m["role"] == "system":
            pending.append(reminder(m["content"]))
            folded += 1
        elif m["role"] == "user" and pending:
            m["content"] = "\n\n".join(pending + [m["content"]] if m["content"] else pending)
            pending = []
            kept.append(m)
        else:
            kept.append(m)
    if pending:  # nothing follows: the last user turn takes them, else they join the system prompt
        last = next((m for m in reversed(kept) if m["role"] == "user"), None)
        if last is not None:
            last["content"] = "\n\n".join([last["content"]] + pending if last["content"] else pending)
        elif out:
            out[0]["content"] += "\n\n" + "\n\n".join(pending)
        else:
            out = [{"role": "system", "content": "\n\n".join(pending)}]
    return out + kept, folded
