"""How coding agents and SDKs reach this server: the lines `edge0 serve` prints at start (the
same setup as docs/server.md's client sections)."""

from __future__ import annotations

import json

KEY_VARIABLE = "EDGE0_API_KEY"
# Coding agents' first request with their default tools: 20k-45k tokens on a real tokenizer
# (docs/clients.md); below this context they cannot start.
AGENT_CONTEXT = 16384


def setup_lines(base_url: str, model: str, keyed: bool) -> list[str]:
    """Client setup for a server at `base_url` (no /v1) reporting `model`. With `keyed` (an
    --api-key is set), clients read the key from $EDGE0_API_KEY; the key itself is never printed."""
    key = f"${KEY_VARIABLE}" if keyed else "edge0"  # without a key, any value does
    codex_key = f', env_key="{KEY_VARIABLE}"' if keyed else ""
    sdk_key = f'os.environ["{KEY_VARIABLE}"]' if keyed else '"edge0"'
    opencode = {
        "provider": {
            "edge0": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "edge0",
                "options": {"baseURL": f"{base_url}/v1", "apiKey": f"{{env:{KEY_VARIABLE}}}" if keyed else "edge0"},
                "models": {model: {"name": model}},
            }
        },
        "model": f"edge0/{model}",
    }
    return [
        f"Claude Code: ANTHROPIC_BASE_URL={base_url} ANTHROPIC_AUTH_TOKEN={key} ANTHROPIC_MODEL={model} "
        f"ANTHROPIC_SMALL_FAST_MODEL={model} claude",
        f'Codex CLI: codex -c model_provider=edge0 -c \'model_providers.edge0={{name="edge0", '
        f'base_url="{base_url}/v1", wire_api="responses"{codex_key}}}\' -m {model}',
        f"opencode: OPENCODE_CONFIG_CONTENT='{json.dumps(opencode, separators=(',', ':'))}' opencode",
        f'OpenAI SDK: OpenAI(base_url="{base_url}/v1", api_key={sdk_key}), model="{model}" (any name is accepted)',
    ]


def agent_warnings(tool_calling: bool, context: int) -> list[str]:
    """What keeps coding agents (which send tools and long prompts) from working with this model."""
    out = []
    if not tool_calling:
        out.append(
            "this model's chat template has no tool-call format Edge0 knows: Claude Code, Codex CLI and opencode "
            "send tools with every request, which will be refused; for agents, serve a model whose format "
            "docs/clients.md lists"
        )
    if context < AGENT_CONTEXT:
        out.append(
            f"this model's context is {context} tokens: coding agents' first request is 20k-45k tokens, so "
            f"they need at least {AGENT_CONTEXT}; for agents, serve a long-context model (docs/clients.md)"
        )
    return out
