"""The valid ranges of the sampling parameters, checked once here for every surface (CLI flags,
server requests, the Python API). Errors name the field so each surface can report it."""

from __future__ import annotations

import math

from edge0.errors import Edge0Error

SEED_MAX = 2**64 - 1  # the random generator takes an unsigned 64-bit seed
# Below this a temperature samples as greedy (vLLM's _SAMPLING_EPS): scaling log-probs by 1/1e-300
# overflows to inf, and a draw from inf and NaN can land on a token a grammar banned.
GREEDY_BELOW = 1e-5


def effective_temperature(temperature: float) -> float:
    """The temperature sampled with: 0 (greedy) below GREEDY_BELOW, else `temperature`."""
    return 0.0 if temperature < GREEDY_BELOW else temperature


def check_sampling(
    temperature: float, top_p: float, seed: int | None, names: dict | None = None, top_k: int = 0
) -> None:
    """Raise Edge0Error unless temperature >= 0 and finite (below GREEDY_BELOW it is greedy),
    0 < top_p <= 1, seed is None or an integer in [0, 2**64 - 1] and top_k an integer >= 0 (0
    keeps every token). `names` maps a
    parameter to the name the caller shows (a flag)."""
    n = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "top_k": "top_k", **(names or {})}
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise Edge0Error(f"{n['temperature']} {temperature}: must be a finite number >= 0 (0 is greedy)")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise Edge0Error(f"{n['top_p']} {top_p}: must be in (0, 1] (1 keeps every token)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX):
        raise Edge0Error(f"{n['seed']} {seed}: must be an integer from 0 to {SEED_MAX}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise Edge0Error(f"{n['top_k']} {top_k}: must be an integer >= 0 (0 keeps every token)")
