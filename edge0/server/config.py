"""Server settings: limits, queue bound, auth. `edge0.serve` fills them from its flags."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from edge0.store.format import CONFIG_FILE

DEFAULT_MAX_PROMPT_TOKENS = 32768  # the context of a model whose config declares none
# max_tokens of a request that names none (aider sends none): a bound, so that one reply cannot run
# to the end of a long context while the next request waits.
DEFAULT_MAX_TOKENS = 4096


@dataclass(frozen=True)
class ServerConfig:
    """Each limit is named after the flag that sets it, so error messages can cite the flag."""

    # --api-key: require a key (Bearer or x-api-key) on /v1/*; with several, each key's clients
    # reuse only their own prompt caches (pipeline.cache_namespace)
    api_key: str | tuple[str, ...] | None = None
    max_queue: int = 16  # --max-queue: requests that may wait behind the running ones
    max_batch: int | None = None  # --max-batch: requests decoded together (None: from memory, batching.py)
    max_body_bytes: int = 4 << 20  # --max-body-bytes
    # Generation limits: a request's max_tokens is clamped to --max-tokens and to what the context
    # (--context-length, the model's own by default) leaves after the prompt.
    max_tokens: int | None = None  # --max-tokens (None: what the context leaves)
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS  # --default-max-tokens: for a request that gives none
    context_length: int = DEFAULT_MAX_PROMPT_TOKENS  # the model's context: prompt + generated tokens
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS  # --max-prompt-tokens (the CLI: the model's context)
    max_messages: int = 512  # --max-messages
    memory_low: int = 0  # --memory-low: shrink the expert cache below this much available memory (0: off)
    memory_poll_s: float = 2.0  # --memory-poll-s: seconds between memory readings
    allowed_hosts: tuple[str, ...] = ()  # --allowed-host: Host names accepted besides loopback and the bound address
    cors_origins: tuple[str, ...] = ()  # --cors-origin: origins whose pages may call the API (CORS)
    served_model_names: tuple[str, ...] = ()  # --served-model-name: the id reported (the first) and aliases
    strict_model_name: bool = False  # --strict-model-name: 404 for a model name not served
    # Connections (connections.py): one local user and a few agents need a handful each; past the cap
    # the oldest idle connection is closed. The timeouts never apply while a response is running.
    max_connections: int = 128  # --max-connections
    header_timeout_s: float = 30.0  # --header-timeout-s: a request's headers must arrive within this
    body_timeout_s: float = 60.0  # --body-timeout-s: its body within this, once the headers are in
    idle_timeout_s: float = 120.0  # --idle-timeout-s: a connection kept open between requests (keep-alive)
    tokenize_concurrency: int = 2  # prompts rendered and tokenized at once before the queue (admission.py)
    # a stream with no event for this long gets a keep-alive event: under the 15 s some clients' idle guards allow
    keepalive_s: float = 10.0
    # --fetch-image-urls: fetch an image given by an http(s) link (any host the server can reach: for
    # trusted clients only); else such a request is a 400 that says to send the image itself
    fetch_image_urls: bool = False

    def api_keys(self) -> tuple[str, ...]:
        """The keys accepted (none: no key is required)."""
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())


def model_context_length(root: Path) -> int | None:
    """The context length a model was trained for: `max_position_embeddings` in its config.json
    (in `text_config` for a multimodal config), or None if it declares none."""
    config = json.loads((Path(root) / CONFIG_FILE).read_text())
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None
