"""The request fields of structured outputs and sampling controls shared by the OpenAI APIs:
response formats (Chat Completions' `response_format`, Responses' `text.format`), forced tool
calls, `logit_bias` and `reasoning_effort`; each becomes a grammar.Constraint or Params fields,
and every bad value a 400 naming the field."""

from __future__ import annotations

import re
from typing import Any

from edge0.server.errors import APIError
from edge0.server.grammar import Constraint, GrammarError, ToolSpec, check_schema
from edge0.server.schemas import ChatJSONSchemaFormat

LOGIT_BIAS_MOST = 100


def format_constraint(fmt, param: str) -> Constraint | None:
    """The constraint of a response format (None for plain text). A JSON object is any object;
    a schema is enforced as given (`strict`: no undeclared properties), and one llguidance
    cannot enforce is a 400 naming what it refuses."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(schema={"type": "object"})
    spec = fmt.json_schema if isinstance(fmt, ChatJSONSchemaFormat) else fmt
    return _checked(Constraint(schema=spec.schema_ or {"type": "object"}, strict=bool(spec.strict)), param)


def tool_constraint(tools: list[ToolSpec], name: str | None, param: str) -> Constraint:
    """One forced call: of the tool `name`, or (None) of any of `tools`; its arguments follow the
    tool's parameter schema (`strict`: no undeclared properties)."""
    if not tools:
        raise APIError(400, "tool_choice forces a tool call, but the request has no tools", param, "invalid_value")
    if name is not None:
        tools = [t for t in tools if t.name == name]
        if not tools:
            raise APIError(400, f"tool_choice names the tool '{name}', which is not in 'tools'", param, "invalid_value")
    return _checked(Constraint(tools=tuple(tools)), param)


def _checked(constraint: Constraint, param: str) -> Constraint:
    schemas = [(constraint.schema, constraint.strict)] if constraint.schema is not None else []
    schemas += [(t.parameters, t.strict) for t in constraint.tools]
    for schema, strict in schemas:
        try:
            check_schema(schema, strict)
        except GrammarError as e:
            raise APIError(400, f"Cannot enforce this schema: {e}", param, "invalid_value") from None
    return constraint


def logit_bias(bias: dict[str, Any] | None, vocab_size: int, param: str = "logit_bias") -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token id as a string -> a number from -100 to 100) as {id: bias}."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        # the length first: int() refuses strings of more than 4,300 digits
        if not re.fullmatch(r"\d+", key) or len(key) > len(str(vocab_size)) or int(key) >= vocab_size:
            shown = key if len(key) <= 40 else f"{key[:40]}... ({len(key)} characters)"
            raise APIError(
                400,
                f"logit_bias key '{shown}' is not a token id of this model (0 to {vocab_size - 1})",
                param,
                "invalid_value",
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not -LOGIT_BIAS_MOST <= value <= LOGIT_BIAS_MOST
        ):
            raise APIError(
                400,
                f"logit_bias['{key}'] is {value!r}: it must be a number from -{LOGIT_BIAS_MOST} to {LOGIT_BIAS_MOST}",
                param,
                "invalid_value",
            )
        out[int(key)] = float(value)
    return out


def thinking_switch(effort: str | None) -> dict:
    """Template kwargs for an OpenAI reasoning effort: "none" turns reasoning off, any other
    effort on (Qwen3-style templates read `enable_thinking`), and the effort itself for templates
    that read it (gpt-oss's `reasoning_effort`: low, medium, high); no effort leaves the template's
    default."""
    return {} if effort is None else {"enable_thinking": effort != "none", "reasoning_effort": effort}
