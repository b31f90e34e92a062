"""Per-token cost of structured outputs on a 150k-token vocabulary: computing the grammar's token
mask (llguidance, and xgrammar when it can be imported) and applying it to a log-probs row in
MLX (edge0.backend.logits.apply_token_mask), for the schemas of tests/fixtures/schemas.py.

Each schema's example document is tokenized with the vocabulary's own BPE (the tokens a model
would emit); at every token the mask is computed, timed, and the token consumed, until the end
of the document and its EOS. Two vocabularies: the bench model's (/work/bench-model/mlx, 151,936
tokens: the fixture's 314 BPE tokens and filler tokens up to the model's vocab) and a byte-level
BPE trained here on data/train.txt, asked for 151,936 tokens (the corpus yields fewer merges:
59,118 tokens of ordinary word and code pieces). Run under the CPU lock:

    flock /tmp/edge0-cpu.lock env PYTHONPATH=$PWD python scripts/grammar_mask_cost.py

xgrammar needs torch, which this project does not install; to compare, install it beside the
project without its dependencies and point --xgrammar-dir at it (a stand-in `torch` module is
then put in place for xgrammar's module-level imports; its masks are computed in C++ into numpy):

    pip install --no-deps --target /tmp/xg xgrammar==0.2.9 apache-tvm-ffi
    ... scripts/grammar_mask_cost.py --xgrammar-dir /tmp/xg
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np

from tests.fixtures.schemas import SCHEMAS

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151_936


def trained_tokenizer(path: Path) -> str:
    """A byte-level BPE trained on data/train.txt to VOCAB tokens (cached at `path`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not path.exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB - 3,
            min_frequency=1,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        )
        tok.train([str(ROOT / "data" / "train.txt")], trainer)
        tok.save(str(path))
    return path.read_text()


def documents() -> list[tuple[str, dict, str]]:
    """(name, schema, compact example) for every schema, and json_object with a nested example."""
    out = [(name, schema, json.dumps(doc, separators=(",", ":"))) for name, (schema, doc) in SCHEMAS.items()]
    nested = {"id": 7, "tags": ["a", "b"], "meta": {"ok": True, "note": "Hello, world: json_object mode"}}
    return out + [("json_object", {"type": "object"}, json.dumps(nested, separators=(",", ":")))]


def llguidance_costs(tokenizer_json: str, eos: int) -> tuple[list[float], float, dict]:
    import llguidance
    import llguidance.numpy as llnp
    from tokenizers import Tokenizer

    from edge0.server.grammar import _json_rule

    hf = Tokenizer.from_str(tokenizer_json)
    started = time.perf_counter()
    ll = llguidance.LLTokenizer(tokenizer_json, eos_token=[eos])
    build_s = time.perf_counter() - started
    mask = llnp.allocate_token_bitmask(1, ll.vocab_size)
    per_token, compile_ms = [], {}
    for name, schema, text in documents():
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(
            ll, llguidance.LLMatcher.grammar_from_lark(f"start: {_json_rule(schema, False)}\n")
        )
        compile_ms[name] = 1000 * (time.perf_counter() - started)
        assert not matcher.is_error(), matcher.get_error()
        for token in hf.encode(text, add_special_tokens=False).ids + [eos]:
            started = time.perf_counter()
            llnp.fill_next_token_bitmask(matcher, mask)
            per_token.append(time.perf_counter() - started)
            assert matcher.consume_token(token), (name, matcher.get_error())
    return per_token, build_s, compile_ms


def xgrammar_costs(tokenizer_json: str, path: Path, eos: int) -> tuple[list[float], float]:
    import xgrammar as xgr
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = Tokenizer.from_str(tokenizer_json)
    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=str(path)), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    build_s = time.perf_counter() - started
    mask = np.full((1, (info.vocab_size + 31) // 32), -1, dtype=np.int32)
    per_token = []
    for name, schema, text in documents():
        matcher = xgr.GrammarMatcher(
            compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        )
        for token in hf.encode(text, add_special_tokens=False).ids + [eos]:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            per_token.append(time.perf_counter() - started)
            assert matcher.accept_token(token), (name, token)
    return per_token, build_s


def torch_stand_in() -> None:
    """A module named `torch` with what xgrammar (and tvm_ffi) touch at import: dtype names and
    a few functions that are never called when masks go into numpy buffers. Measurement only."""
    try:
        import torch  # noqa: F401

        return
    except ImportError:
        pass

    class DType:
        def __init__(self, name):
            self.name = name

    stub = types.ModuleType("torch")
    stub.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    stub.__version__ = "0.0"
    stub.Tensor, stub.device, stub.dtype = type("Tensor", (), {}), type("device", (), {}), DType
    stub.cuda = types.SimpleNamespace(is_available=lambda: False)
    stub.nn = types.SimpleNamespace(functional=types.SimpleNamespace())
    stub.library = types.SimpleNamespace()
    stub.compile = lambda *a, **k: lambda f: f
    stub.tensor = lambda *a, **k: None
    stub.__getattr__ = lambda name: (
        DType(name) if not name.startswith("__") else (_ for _ in ()).throw(AttributeError(name))
    )
    sys.modules["torch"] = stub


def apply_cost(repeats: int = 200) -> list[float]:
    """Seconds to mask a [1, VOCAB] float32 row in MLX (evaluated), with a mask allowing ~1% of tokens."""
    from edge0.backend import core as B
    from edge0.backend.logits import apply_token_mask

    rng = np.random.default_rng(0)
    row = B.array(rng.standard_normal((1, VOCAB)).astype(np.float32))
    bits = np.packbits(rng.random(VOCAB) < 0.01, bitorder="little")
    mask = np.zeros(((VOCAB + 31) // 32) * 4, np.uint8)
    mask[: len(bits)] = bits
    mask = mask.view(np.int32)
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        B.eval(apply_token_mask(row, mask))
        out.append(time.perf_counter() - started)
    return out


def summary(seconds: list[float]) -> str:
    us = sorted(1e6 * s for s in seconds)

    def q(f: float) -> float:
        return us[min(len(us) - 1, int(f * len(us)))]

    return (
        f"{len(us)} tokens: mean {statistics.mean(us):.0f} us, median {q(0.5):.0f}, p90 {q(0.9):.0f}, "
        f"p99 {q(0.99):.0f}, max {us[-1]:.0f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench-tokenizer", default="/work/bench-model/mlx/tokenizer.json")
    p.add_argument("--trained", default="/tmp/edge0-bpe-151936.json", help="where the trained BPE is cached")
    p.add_argument("--xgrammar-dir", help="a directory holding xgrammar installed without its dependencies")
    args = p.parse_args()
    if args.xgrammar_dir:
        sys.path.insert(0, args.xgrammar_dir)
        torch_stand_in()
    vocabularies = []
    if Path(args.bench_tokenizer).exists():
        vocabularies.append(("bench model (314 BPE + fillers)", Path(args.bench_tokenizer), "<|im_end|>"))
    trained = Path(args.trained)
    trained_tokenizer(trained)
    vocabularies.append(("BPE trained on data/train.txt", trained, "<|im_end|>"))
    for label, path, eos_name in vocabularies:
        from tokenizers import Tokenizer

        text = path.read_text()
        hf = Tokenizer.from_str(text)
        eos = hf.token_to_id(eos_name)
        print(f"== {label}: {hf.get_vocab_size()} tokens")
        per_token, build_s, compile_ms = llguidance_costs(text, eos)
        print(
            f"llguidance: tokenizer built in {build_s:.2f} s; grammar compile {min(compile_ms.values()):.1f}-"
            f"{max(compile_ms.values()):.1f} ms; mask {summary(per_token)}"
        )
        try:
            per_token, build_s = xgrammar_costs(text, path, eos)
            print(f"xgrammar: tokenizer info + compiler in {build_s:.2f} s; mask {summary(per_token)}")
        except ImportError as e:
            print(f"xgrammar: not importable here ({e})")
    print(f"apply the mask to a [1, {VOCAB}] row in MLX: {summary(apply_cost())}")


if __name__ == "__main__":
    main()
