"""Structured outputs with llguidance: a request's constraint (a JSON schema, or forced tool calls
with their arguments' schemas) becomes a Lark grammar, and a logits processor masks, before each
sampling step, every token the grammar does not allow next (docs/server.md: why llguidance, and
what the mask costs per token).

Schemas are checked when the request arrives (no tokenizer needed), so an invalid schema or a
feature llguidance cannot enforce is a 400 naming it, before anything is queued.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from dataclasses import dataclass

import llguidance
import llguidance.numpy as llnp

from edge0.backend import logits as blog
from edge0.formats import detect

# Compact JSON: flexible whitespace would let a model pad forever between tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema or grammar llguidance refuses; the message says why (a 400)."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict
    strict: bool = False


@dataclass(frozen=True)
class Constraint:
    """What the output must be: a JSON value of `schema`, or one call of one of `tools` in the
    tokenizer's tool-call markup."""

    schema: dict | None = None
    strict: bool = False
    tools: tuple[ToolSpec, ...] = ()


def strict_schema(schema: dict) -> dict:
    """OpenAI's strict mode: an object schema that does not say otherwise allows no properties
    beyond those it declares (applied to every nested object schema)."""
    schema = copy.deepcopy(schema)

    def visit(node):
        # only subschemas: values under const, enum, default or examples are data, not schemas
        if not isinstance(node, dict):
            return
        if node.get("type") == "object" or "properties" in node:
            node.setdefault("additionalProperties", False)
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                for sub in node[key].values():
                    visit(sub)
        for key in SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                for sub in node[key]:
                    visit(sub)
        for key in SCHEMA_KEYS:
            visit(node.get(key))

    visit(schema)
    return schema


# The JSON-schema keywords whose values are schemas (maps of them, lists of them, or one).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_KEYS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _json_rule(schema: dict, strict: bool) -> str:
    """`%json {...}`: a Lark rule for `schema`, with compact whitespace."""
    schema = strict_schema(schema) if strict else schema
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}})


# Deeper schemas are refused before they are copied or compiled (both recurse; 300 levels raised
# RecursionError). Real schemas nest a few levels.
MAX_SCHEMA_DEPTH = 64


def check_schema(schema: dict, strict: bool = False) -> None:
    """Raise GrammarError unless llguidance can enforce `schema` exactly."""
    depth = nesting(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the schema nests {depth} levels deep, more than the {MAX_SCHEMA_DEPTH} this server takes")
    validate(f"start: {_json_rule(schema, strict)}\n")


def nesting(value) -> int:
    """How deep lists and objects nest in a JSON-like value (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((c, depth + 1) for c in children)
    return deepest


def validate(grammar: str) -> None:
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(grammar)
    )
    if failed:
        raise GrammarError(_one_line(messages[0]))


def _one_line(message: str) -> str:
    """llguidance's message without its grammar position, on one line."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return re.sub(r"^at \d+\(\d+\): ", "", text)[:400]


class Grammars:
    """The llguidance view of one engine's tokenizer, built on first use (0.5 s for a 152k
    vocabulary, docs/server.md), and the processors of structured requests, with their cost counted."""

    def __init__(self, tokenizer, fmt=None):
        """`fmt`: the chat format whose call markers a forced call is generated between (by default
        the tokenizer's, edge0.formats.detect)."""
        self.tokenizer = tokenizer
        self.format = fmt if fmt is not None else detect(tokenizer)
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # /v1/stats "sampling": structured requests, masks computed and their time; the thinking
        # budgets applied, and those a tokenizer's multi-token markers left unenforced (pipeline.py).
        self.stats = {
            "structured_requests": 0,
            "masks": 0,
            "mask_ms": 0.0,
            "thinking_budgets": 0,
            "thinking_budgets_unenforced": 0,
        }

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                backend = getattr(self.tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise GrammarError("structured outputs need a fast (tokenizer.json) tokenizer; this model has none")
                self._ll = llguidance.LLTokenizer(backend.to_str(), eos_token=list(self.tokenizer.eos_token_ids))
            return self._ll

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token (a special token's text)."""
        return self.ll_tokenizer().decode_bytes([token])

    def _literal(self, marker: str) -> str:
        """A Lark item matching `marker`: its token when llguidance sees it as a special token
        (which no text matches), else the text."""
        ids = self.tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and self.ll_tokenizer().is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(marker)

    def grammar(self, constraint: Constraint, think: tuple[str, str, bool] | None = None) -> str:
        """The Lark grammar of `constraint`. With `think` (think_start, think_end, opened) the output
        first finishes the reasoning block the prompt opened, or (not opened) may begin with one:
        any text up to think_end."""
        if constraint.tools:
            start, end = self.format.call_start, self.format.call_end
            calls = []
            for tool in constraint.tools:
                call = {
                    "type": "object",
                    "properties": {"name": {"const": tool.name}, "arguments": tool.parameters or {"type": "object"}},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                calls.append(_json_rule(call, tool.strict))
            body = f'{self._literal(start)} "\\n" call "\\n" {self._literal(end) if end else ""}'
            rules = "call: " + "\n    | ".join(calls) + "\n"
        else:
            body, rules = "json", f"json: {_json_rule(constraint.schema, constraint.strict)}\n"
        if think:
            block = f'think {self._literal(think[1])} ("\\n" "\\n"?)?'
            block = block if think[2] else f"({self._literal(think[0])} {block})?"
            return f"start: {block} {body}\nthink: /(?s:.*)/\n{rules}"
        return f"start: {body}\n{rules}"

    def processor(self, constraint: Constraint, think: tuple[str, str, bool] | None = None) -> GrammarProcessor:
        grammar = self.grammar(constraint, think)
        self.stats["structured_requests"] += 1
        return GrammarProcessor(self.ll_tokenizer(), grammar, self.stats)


class GrammarProcessor:
    """A logits processor (edge0/engine/sampler.py): consumes the tokens sampled since its last
    call, then masks the tokens the grammar does not allow next. Runs on the engine thread."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, stats: dict):
        self.matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if self.matcher.is_error():
            raise GrammarError(_one_line(self.matcher.get_error()))
        self.mask = llnp.allocate_token_bitmask(1, tokenizer.vocab_size)
        self.consumed = 0
        self.stats = stats

    def __call__(self, generated: list[int], logprobs):
        for token in generated[self.consumed :]:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self.consumed = len(generated)
        started = time.perf_counter()
        llnp.fill_next_token_bitmask(self.matcher, self.mask)
        self.stats["masks"] += 1
        self.stats["mask_ms"] += 1000 * (time.perf_counter() - started)
        return blog.apply_token_mask(logprobs, self.mask[0])

    def done(self) -> bool:
        """The output so far is complete under the grammar."""
        return self.matcher.is_accepting()
