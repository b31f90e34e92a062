"""Server settings: limits, queue bound, auth. `edge0.serve` fills them from its flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """Each limit is named after the flag that sets it, so error messages can cite the flag."""

    api_key: str | None = None  # --api-key: require "Authorization: Bearer <key>" on /v1/*
    max_queue: int = 16  # --max-queue: requests that may wait behind the running one
    max_body_bytes: int = 4 << 20  # --max-body-bytes
    max_tokens: int = 4096  # --max-tokens: the most a request may ask for
    default_max_tokens: int = 512  # --default-max-tokens: used when a request gives none
    max_prompt_tokens: int = 32768  # --max-prompt-tokens
    max_messages: int = 512  # --max-messages
