"""The tools of a Responses request, as Codex CLI sends them: function tools, `namespace` groups of
function tools, and tools the platform would run (web_search, file_search, ...).

The model sees function tools only. A namespace's tools are flattened to `NAMESPACE__NAME`
(Codex's own flat form of a namespaced name, codex-rs/protocol/src/tool_name.rs), and a call to
one goes back as a `function_call` item with `name` and `namespace` split again. Hosted tools
cannot run here: they are left out of the prompt (counted in /v1/stats), and refused with a 400
only when `tool_choice` forces one.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from edge0.server.errors import APIError
from edge0.server.grammar import ToolSpec
from edge0.server.schemas import Strict, tagged_union

NAMESPACE_DELIMITER = "__"
HOSTED_TOOLS_LEFT_OUT = (
    "hosted_tools_left_out",
    "a request offered tools that the platform runs (web_search and the like); this server runs none, so they "
    "are left out of the prompt (counted in /v1/stats as hosted_tools_left_out)",
)


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class NamespaceTool(Strict):
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    tools: list[FunctionTool]


class HostedTool(BaseModel):
    """A tool the platform runs (web_search, file_search, code_interpreter, mcp, ...): kept as sent."""

    model_config = ConfigDict(extra="allow")
    type: str


def _tag(value) -> str | None:
    """The `type` of an object (a dict, or a model already validated); None for anything else,
    which pydantic then refuses (a 400 naming the field, not an AttributeError)."""
    if isinstance(value, dict):
        return value.get("type")
    return getattr(value, "type", None) if isinstance(value, BaseModel) else None


def _tool_kind(tool) -> str | None:
    if not isinstance(tool, (dict, BaseModel)):
        return None
    kind = _tag(tool)
    return kind if kind in ("function", "namespace") else "hosted"


Tool = tagged_union(
    _tool_kind,
    {"function": FunctionTool, "namespace": NamespaceTool, "hosted": HostedTool},
    "invalid_tool",
    "a tool must be an object with a type (function, namespace, or a hosted tool's)",
)


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class NamedHosted(BaseModel):
    """tool_choice forcing a hosted tool ({"type": "web_search"}, ...)."""

    model_config = ConfigDict(extra="allow")
    type: str


def _choice_kind(choice) -> str | None:
    if isinstance(choice, str):
        return "mode"
    if not isinstance(choice, (dict, BaseModel)):
        return None
    return "function" if _tag(choice) == "function" else "hosted"


ToolChoice = tagged_union(
    _choice_kind,
    {"mode": Literal["auto", "none", "required"], "function": NamedFunction, "hosted": NamedHosted},
    "invalid_tool_choice",
    "tool_choice must be 'auto', 'none', 'required' or an object with a type",
)


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees: Codex's flat form of a namespaced tool name."""
    if namespace is None:
        return name
    return f"{namespace.rstrip('_')}{NAMESPACE_DELIMITER}{name.lstrip('_')}"


class ResponsesTools:
    """A request's tools, flattened for the chat template; `split` maps a flat name back."""

    def __init__(self, tools: list | None, tool_choice):
        self.functions: list[tuple[str, FunctionTool]] = []  # (flat name, tool)
        self.namespaced: dict[str, tuple[str, str]] = {}  # flat name -> (namespace, name)
        self.hosted = [t.type for t in tools or [] if isinstance(t, HostedTool)]
        for tool in tools or []:
            if isinstance(tool, FunctionTool):
                self.functions.append((tool.name, tool))
            elif isinstance(tool, NamespaceTool):
                for inner in tool.tools:
                    flat = flat_name(tool.name, inner.name)
                    self.functions.append((flat, inner))
                    self.namespaced[flat] = (tool.name, inner.name)
        if isinstance(tool_choice, NamedHosted):
            raise APIError(
                400,
                f"tool_choice forces the tool '{tool_choice.type}', which this server cannot run (it runs no hosted "
                "tools; offer a function tool instead)",
                "tool_choice",
                "unsupported_value",
            )
        if tool_choice == "required" and not self.functions and self.hosted:
            raise APIError(
                400,
                f"tool_choice 'required' with only hosted tools ({', '.join(self.hosted)}), which this server "
                "cannot run",
                "tool_choice",
                "unsupported_value",
            )

    def template_tools(self) -> list[dict] | None:
        """Function tools as the chat template takes them (Chat Completions' shape)."""
        return [
            {
                "type": "function",
                "function": {"name": flat, **tool.model_dump(exclude_none=True, exclude={"type", "strict", "name"})},
            }
            for flat, tool in self.functions
        ] or None

    def specs(self) -> list[ToolSpec]:
        return [ToolSpec(flat, t.parameters or {"type": "object"}, bool(t.strict)) for flat, t in self.functions]

    def split(self, flat: str) -> tuple[str | None, str]:
        """(namespace, name) of the tool the model called by its flat name."""
        return self.namespaced.get(flat, (None, flat))

    def notes(self) -> tuple:
        return (HOSTED_TOOLS_LEFT_OUT,) if self.hosted else ()
