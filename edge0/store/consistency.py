"""config.json against the store it sits in, before the model is built from it: sizes and counts
are positive integers, numbers are finite, and the layer count, the embedding and the expert count
agree with the weights the store holds (their safetensors headers, no tensor read).

mlx-lm builds whatever a config describes: a config of 10^6 layers was built for 75 s before
running out of memory, a zero head count divided by zero and an infinite value overflowed, each in
a traceback. Here each is one line naming the field, the value and what the store holds.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from edge0.errors import Edge0Error
from edge0.spec import text_config
from edge0.store.format import RESIDENT_FILE
from edge0.store.headers import read_header

# Sizes and counts a model is built from; each that a config gives must be an integer >= 1.
SIZES = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_experts_per_tok",
    "max_position_embeddings",
)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

FIX = "put back the config.json the store was converted with, or convert the checkpoint again"


def check_config(root: Path, config: dict, manifest: dict) -> None:
    """An Edge0Error naming root/config.json and the first field that is not a valid size, not
    finite, or disagrees with the store's weights."""
    path = Path(root) / "config.json"
    text = text_config(config)
    for key in SIZES + EXPERT_COUNTS:
        value = text.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise Edge0Error(f"{path}: {key} is {value!r}, not an integer >= 1; {FIX}")
    for key, value in _numbers(config):
        if not math.isfinite(value):
            raise Edge0Error(f"{path}: {key} is {value}, not a finite number; {FIX}")
    resident = read_header(Path(root) / RESIDENT_FILE).tensors
    _check_layers(path, text, resident, manifest)
    if config["model_type"] != manifest["model_type"]:
        return  # another family: the loader says so (its sizes would only confuse the message)
    _check_embedding(path, text, resident, config.get("quantization") or {})
    experts = {entry["num_experts"] for entry in manifest["expert_layers"]}
    for key in EXPERT_COUNTS:
        if text.get(key) is not None and {text[key]} != experts:
            raise Edge0Error(
                f"{path}: {key} is {text[key]}, but the store's expert layers hold {_list(experts)}; {FIX}"
            )


def _numbers(value, key: str = ""):
    """(dotted key, value) of every float in a JSON-like value."""
    if isinstance(value, float):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{key}[{i}]")


def _check_layers(path: Path, text: dict, resident: dict, manifest: dict) -> None:
    """num_hidden_layers must be the number of decoder layers the weights hold (checked before the
    model is built, which costs time and memory in the layer count)."""
    layers = text.get("num_hidden_layers")
    names = list(resident) + [entry["module"] + "." for entry in manifest["expert_layers"]]
    found = {int(m.group(1)) for name in names if (m := _LAYER.search(name))}
    if layers is not None and found and max(found) + 1 != layers:
        raise Edge0Error(
            f"{path}: num_hidden_layers is {layers}, but the store's weights hold {max(found) + 1} layers; {FIX}"
        )


def _check_embedding(path: Path, text: dict, resident: dict, quantization: dict) -> None:
    """vocab_size and hidden_size against the embedding's shape."""
    name = next((n for n in resident if n.endswith("embed_tokens.weight")), None)
    if name is None:
        return
    dtype, shape = resident[name]
    if len(shape) != 2:
        return
    rows, width = shape
    module = name.removesuffix(".weight")
    if module + ".scales" in resident:  # packed: 32 / bits values per uint32
        own = quantization.get(module)
        bits = own["bits"] if isinstance(own, dict) else quantization.get("bits", 4)
        width = width * 32 // bits
    for key, held in (("vocab_size", rows), ("hidden_size", width)):
        if text.get(key) is not None and text[key] != held:
            raise Edge0Error(
                f"{path}: {key} is {text[key]}, but the store's embedding ({name}, {dtype} {shape}) has {held}; {FIX}"
            )


def _list(values: set) -> str:
    return " and ".join(map(str, sorted(values))) + " experts"
