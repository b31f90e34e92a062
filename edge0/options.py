"""LoadOptions: every option that changes how a model is loaded and served, declared once.

Each field carries its default, its allowed values and its help text. The CLI's flags
(`edge0.cli.common.add_model_options`), the keywords of `edge0.load`, the checks below and the
table in docs/engine-api.md all come from these fields (a test keeps them in step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from edge0.cache import LIVE_POLICIES
from edge0.engine.drafters import DEFAULT_NGRAM, DEFAULT_NUM_DRAFT
from edge0.errors import Edge0Error
from edge0.store.readers import STRATEGIES
from edge0.streaming.dispatch import DECODE_EXECUTORS, PREFILL_EXECUTORS, TRAIN_WEIGHTS
from edge0.streaming.lookahead import MODES as LOOKAHEAD_MODES
from edge0.units import parse_rate, parse_size

COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_PROMPT_CACHE_SIZE = "2GB"
MAX_DRAFT = 64


def _opt(default, help: str, kind: str, **extra):
    """A LoadOptions field. `kind` says how the CLI spells it: choice, int, float, size, path,
    flag (--NAME sets it), switch (--NAME / --no-NAME), split (N,N,...), tristate (FILE, or --no-NAME
    for False) or layer_executors (repeatable).
    `checked_later`: the CLI leaves the choice to validate(), whose error explains more."""
    factory = {"default_factory": dict} if default == {} else {"default": default}
    return field(**factory, metadata={"help": help, "kind": kind, **extra})


@dataclass
class LoadOptions:
    """How `edge0.load` opens a store and streams its experts (see docs/engine-api.md)."""

    dtype: str = _opt(
        "auto",
        "compute dtype (default auto: float32 on CPU, the checkpoint's dtype on GPU)",
        "choice",
        choices=COMPUTE_DTYPES,
    )
    top_k: int | None = _opt(None, "serving width: experts per token (default: the model's)", "int")
    verify: bool = _opt(False, "check every store file's sha256 before loading", "flag")
    trust_remote_code: bool = _opt(
        False,
        "load a tokenizer that is Python code shipped with the model (Kimi's); it runs with your rights",
        "flag",
    )
    expert_cache: int | str | None = _opt(
        None, "memory for cached experts, e.g. 2GB (default: from free memory and model size)", "size"
    )
    context_tokens: int | None = _opt(
        None,
        "context length whose KV cache the default expert cache leaves memory for (default 4096, or the "
        "model's own if shorter); sizes memory only, prompts are not limited by it",
        "int",
        metavar="N",
    )
    cache_policy: str = _opt(
        "lru",
        "expert-cache eviction policy: lru (default), lfu, arc, smoe (router scores), flashmoe (learned)",
        "choice",
        choices=LIVE_POLICIES,
        checked_later=True,
    )
    cache_weights: str | None = _opt(
        None, "flashmoe: weights from edge0 train-cache-policy, trained on a trace of this model", "path"
    )
    smoe_window: int | None = _opt(
        None, "smoe: steps over which router scores are averaged (default 32)", "int", metavar="N"
    )
    substitute_alpha: float = _opt(
        0.0,
        "LOSSY, CHANGES OUTPUTS: a routed expert scoring in [S, (1+A)S] (S: best "
        "unselected score) may be replaced by a cached one scoring in [(1-A)S, S], "
        "saving its read (default 0: off)",
        "float",
        metavar="A",
    )
    prefill_executor: str = _opt(
        "whole",
        "prefill: whole-layer reads (default) or exact per-expert reads",
        "choice",
        choices=tuple(PREFILL_EXECUTORS),
    )
    decode_executor: str = _opt(
        "staged",
        "decode: staged slots (default), hot set + exact misses, or exact",
        "choice",
        choices=tuple(DECODE_EXECUTORS),
    )
    lookahead: str = _opt(
        "auto",
        "decode: read the next MoE layer's experts as predicted by its router on this layer's input, "
        "while this layer computes: auto (default: for layers whose predictions lately agreed), on, off",
        "choice",
        choices=LOOKAHEAD_MODES,
    )
    prefill_span: int | None = _opt(
        None,
        "tokens per layer-major prefill span: each span reads each layer's experts once (default: "
        "as many as keep the span's activations under 512 MB)",
        "int",
        metavar="N",
    )
    kv_bits: int | None = _opt(
        None, "quantize the KV cache to 4 or 8 bits (mlx-lm's quantized cache; default: not quantized)", "int"
    )
    kv_group_size: int = _opt(64, "group size of the quantized KV cache: 32, 64 (default) or 128", "int")
    layer_executors: dict = _opt(
        {},
        "per-layer override, e.g. 3:decode=hot (repeatable)",
        "layer_executors",
        flag="--layer-executor",
        metavar="LAYER:PHASE=NAME",
    )
    prerouter: str | bool | None = _opt(
        None,
        "pre-router heads (default: the store's prerouter.safetensors, if any)",
        "tristate",
        off_help="route every layer with its own gate",
    )
    prerouter_diagnostics: bool = _opt(
        False, "also evaluate the gate on pre-routed layers and report recall (slower)", "flag"
    )
    lora: str | bool | None = _opt(
        None,
        "recovery LoRA adapter (default: the store's adapter for this K and routing, if any)",
        "tristate",
        off_help="serve without the recovery LoRA",
    )
    draft: str | None = _opt(
        None,
        "speculative decoding: ngram (prompt lookup over the prompt and the generated text), the "
        "directory of an mlx-lm draft model with the same tokenizer, or none (default)",
        "path",
        metavar="ngram|PATH|none",
    )
    num_draft: int | None = _opt(
        None, f"speculative decoding: tokens drafted per verify step (default {DEFAULT_NUM_DRAFT})", "int", metavar="N"
    )
    draft_ngram: int | None = _opt(
        None, f"--draft ngram: the longest n-gram matched (default {DEFAULT_NGRAM})", "int", metavar="N"
    )
    draft_adaptive: bool = _opt(
        True,
        "speculative decoding switches itself off while the measured acceptance and verify cost make it "
        "slower than plain decoding, and back on (default on; --no-draft-adaptive keeps it on)",
        "switch",
    )
    io: str = _opt(
        "auto",
        "how expert bytes are read: auto (default: pread when the experts fit in half the memory "
        "available, else direct), mmap, pread (preallocated buffers, reads in flight), direct "
        "(bypasses the page cache)",
        "choice",
        choices=("auto", *STRATEGIES),
    )
    check_experts: bool = _opt(
        True,
        "check the resident weights (crc32) while they load and each expert against its crc32 in "
        "the manifest the first time this process reads it (default on; --no-check-experts turns both off)",
        "switch",
    )
    cold_reads: bool = _opt(
        False, "drop every expert read from the OS page cache again (benchmarks of cold storage)", "flag"
    )
    pace_reads: str | None = _opt(
        None,
        "read experts as from a disk of RATE, e.g. 20MB/s: each read's bytes from storage (page-cache hits "
        "excluded) queue behind the ones before and arrive at RATE (benchmarks of storage slower than this one)",
        "size",
        metavar="RATE",
    )
    prompt_cache_dir: str | None = _opt(
        None,
        "keep the KV caches of finished conversations (chat, serve) in DIR, so a "
        "restarted process reuses a matching prefix",
        "path",
        metavar="DIR",
    )
    prompt_cache_size: int | str | None = _opt(
        None,
        f"most bytes --prompt-cache-dir holds; the least recently used go first (default {DEFAULT_PROMPT_CACHE_SIZE})",
        "size",
    )
    prompt_cache_memory: int | str | None = _opt(
        None,
        "memory for the KV caches of other conversations, kept beside the one in flight (an agent's "
        "main thread, side requests, subagents), e.g. 1GB; 0 keeps only the last (default: the KV cache of "
        "two conversations at the context served: the model's own, or --context-tokens if longer; at most a "
        "quarter of the memory left for the expert cache)",
        "size",
    )
    pipeline_split: str | tuple | None = _opt(
        None,
        "under mlx.launch: decoder layers per rank, rank 0 first "
        "(rank 0 runs the last layers), e.g. 12,12 (default: balanced "
        "by bytes)",
        "split",
        metavar="N,N,...",
    )
    peer_timeout: float = _opt(
        60.0,
        "under mlx.launch: seconds a rank waits for its peers to connect, and about how long a peer may go "
        "silent (its machine asleep or off the network, or its process stopped) before the others stop "
        "(default 60)",
        "float",
        metavar="S",
    )

    def validate(self) -> "LoadOptions":
        """Check the options that need no model; errors name the flag and the fix."""
        if self.dtype is None:
            self.dtype = "auto"
        _choice("dtype", self.dtype)
        _choice("io", self.io)
        if self.pace_reads is not None:
            self.pace_reads = parse_rate(self.pace_reads, "--pace-reads")
        if self.top_k is not None and self.top_k < 1:
            raise Edge0Error(f"--top-k {self.top_k}: must be >= 1 (the number of experts per token)")
        if self.context_tokens is not None and self.context_tokens < 1:
            raise Edge0Error(f"--context-tokens {self.context_tokens}: must be >= 1 (tokens of KV cache)")
        _choice(
            "cache_policy", self.cache_policy, hint="; belady needs the future, so it runs only in `edge0 simulate`"
        )
        if self.cache_policy == "flashmoe" and not self.cache_weights:
            raise Edge0Error(f"--cache-policy flashmoe needs --cache-weights FILE; train one with: {TRAIN_WEIGHTS}")
        if self.cache_weights and self.cache_policy != "flashmoe":
            raise Edge0Error(
                "--cache-weights is read only by the flashmoe policy; add --cache-policy flashmoe or "
                "drop --cache-weights"
            )
        if self.smoe_window is not None and self.cache_policy != "smoe":
            raise Edge0Error(
                "--smoe-window is read only by the smoe policy; add --cache-policy smoe or drop --smoe-window"
            )
        if self.smoe_window is not None and self.smoe_window < 1:
            raise Edge0Error(f"--smoe-window {self.smoe_window}: must be >= 1 step")
        if not 0 <= self.substitute_alpha < math.inf:
            raise Edge0Error(
                f"--substitute-alpha {self.substitute_alpha}: must be a finite number >= 0 (0 turns substitution off)"
            )
        if self.substitute_alpha and self.decode_executor != "staged":
            raise Edge0Error(
                "--substitute-alpha needs the staged decode executor (it substitutes from the expert "
                f"cache); drop --decode-executor {self.decode_executor} or --substitute-alpha"
            )
        if self.prompt_cache_size is not None and not self.prompt_cache_dir:
            raise Edge0Error(
                "--prompt-cache-size is read only with --prompt-cache-dir; add --prompt-cache-dir DIR or "
                "drop --prompt-cache-size"
            )
        if self.prompt_cache_dir and self.prompt_cache_bytes() < 1:
            raise Edge0Error(f"--prompt-cache-size {self.prompt_cache_size}: must be more than 0 bytes, e.g. 2GB")
        if self.prompt_cache_memory is not None and parse_size(self.prompt_cache_memory, "--prompt-cache-memory") < 0:
            raise Edge0Error(f"--prompt-cache-memory {self.prompt_cache_memory}: must be 0 or more bytes, e.g. 1GB")
        if self.prefill_span is not None and self.prefill_span < 2:
            raise Edge0Error(f"--prefill-span {self.prefill_span}: must be >= 2 tokens (e.g. 8192)")
        if self.kv_bits is not None and self.kv_bits not in (4, 8):
            raise Edge0Error(f"--kv-bits {self.kv_bits}: choose 4 or 8 (or leave it out for a float KV cache)")
        if self.kv_group_size not in (32, 64, 128):
            raise Edge0Error(f"--kv-group-size {self.kv_group_size}: choose 32, 64 or 128")
        if self.pipeline_split is not None:
            self.pipeline_split = parse_split(self.pipeline_split)
        if not 0 < self.peer_timeout < math.inf:
            raise Edge0Error(f"--peer-timeout {self.peer_timeout}: must be a finite number of seconds > 0")
        self._validate_draft()
        _choice("prefill_executor", self.prefill_executor)
        _choice("decode_executor", self.decode_executor)
        _choice("lookahead", self.lookahead)
        for layer, choice in self.layer_executors.items():
            for phase, name in choice.items():
                if phase not in ("prefill", "decode"):
                    raise Edge0Error(f"--layer-executor {layer}:{phase}={name}: the phase is prefill or decode")
                _choice(f"{phase}_executor", name, f" (layer {layer})")
        return self

    def _validate_draft(self) -> None:
        speculating = self.draft not in (None, "none")
        if self.num_draft is not None and not speculating:
            raise Edge0Error(
                "--num-draft is read only with --draft; add --draft ngram (or a model) or drop --num-draft"
            )
        if self.num_draft is not None and not 1 <= self.num_draft <= MAX_DRAFT:
            raise Edge0Error(f"--num-draft {self.num_draft}: must be from 1 to {MAX_DRAFT} tokens")
        if self.draft_ngram is not None and self.draft != "ngram":
            raise Edge0Error("--draft-ngram is read only with --draft ngram; add it or drop --draft-ngram")
        if self.draft_ngram is not None and self.draft_ngram < 1:
            raise Edge0Error(f"--draft-ngram {self.draft_ngram}: must be >= 1 token")
        if speculating and self.substitute_alpha:
            raise Edge0Error(
                "--substitute-alpha changes outputs step by step, which a verify step cannot reproduce; "
                "drop --draft or --substitute-alpha"
            )

    def prompt_cache_bytes(self) -> int:
        """The size bound of --prompt-cache-dir in bytes."""
        size = DEFAULT_PROMPT_CACHE_SIZE if self.prompt_cache_size is None else self.prompt_cache_size
        return parse_size(size, "--prompt-cache-size")

    def executor(self, layer: int, phase: str) -> str:
        """The executor `layer` uses in `phase` ("prefill" or "decode")."""
        return self.layer_executors.get(layer, {}).get(phase, getattr(self, f"{phase}_executor"))


def parse_split(text) -> tuple[int, ...]:
    """'12,12' (or a sequence of ints) -> (12, 12); an Edge0Error naming --pipeline-split."""
    try:
        parts = [int(p) for p in (text.split(",") if isinstance(text, str) else text)]
    except (TypeError, ValueError):
        parts = []
    if not parts or any(p < 1 for p in parts):
        raise Edge0Error(f"--pipeline-split {text!r}: expected layers per rank, rank 0 first, each >= 1, e.g. 12,12")
    return tuple(parts)


def flag(name: str) -> str:
    """The command-line flag of a LoadOptions field: expert_cache -> --expert-cache."""
    f = next(f for f in fields(LoadOptions) if f.name == name)
    return f.metadata.get("flag", "--" + name.replace("_", "-"))


def _choice(name: str, value, where: str = "", hint: str = "") -> None:
    choices = next(f for f in fields(LoadOptions) if f.name == name).metadata["choices"]
    if value not in choices:
        raise Edge0Error(f"{flag(name)}{where} {value!r}: choose one of {', '.join(choices)}{hint}")
