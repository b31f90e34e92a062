"""One generation request, as every surface hands it to the engine (the CLI, `edge0.load(...)`,
the server, the bench): the prompt's token ids, the limits, the sampling and where its KV may be
reused. `check` is the one place its fields are validated; the engine's loop (batch.py) builds
the request's sampler and reply from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge0.errors import Edge0Error
from edge0.sampling import check_sampling


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # its own random stream (a batch's other rows do not change its draws)
    stop: list[str] | None = None
    processors: list = field(default_factory=list)  # logits processors (edge0/engine/sampler.py)
    logprobs: int | None = None  # report each token's log-prob and this many top ones
    ignore_eos: bool = False
    reuse: bool = False  # start from the prompt caches and give its KV back there (kv.py)
    namespace: str = ""  # the prompt caches it may reuse (a cache_salt, an API key)
    # a prompt with images (edge0.backend.vision.ImagePrompt): `prompt` is its tokens, each image's expanded
    vision: object = None

    def check(self) -> None:
        """Raise Edge0Error naming the field that is out of range."""
        if not self.prompt:
            raise Edge0Error("prompt is empty; pass some text or token ids")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise Edge0Error(f"max_tokens must be an integer >= 1 (got {m!r})")
        check_sampling(self.temperature, self.top_p, self.seed, top_k=self.top_k)
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise Edge0Error(f"logprobs {n!r}: must be None or an integer >= 0 (the top log-probs per token)")
