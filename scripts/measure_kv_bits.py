"""KV-cache bytes and prefill time with and without --kv-bits (docs/long-prompts.md).

Loads the store (default: the bundled demo model) once per setting, prefills --tokens tokens of
data/valid.txt with reuse_cache (so the cache is kept) and reports the cache's bytes.

    PYTHONPATH=$PWD python scripts/measure_kv_bits.py [--model STORE] [--tokens 4000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import edge0  # noqa: E402
from edge0.backend import kvcache as bkv  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for bits in (None, 8, 4):
        engine = edge0.load(args.model, kv_bits=bits)
        ids = engine.tokenizer.encode((ROOT / "data" / "valid.txt").read_text()[: args.tokens * 8])[: args.tokens]
        stats = engine.generate(ids, max_tokens=1, reuse_cache=True).stats
        nbytes = bkv.prompt_cache_nbytes(engine.kv.cache)
        rows.append(
            {
                "kv_bits": bits,
                "tokens": len(engine.kv.tokens),
                "kv_cache_bytes": nbytes,
                "bytes_per_token": nbytes / len(engine.kv.tokens),
                "prefill_tps": stats["prefill_tps"],
                "peak_memory_bytes": stats["peak_memory_bytes"],
            }
        )
        print(rows[-1], flush=True)
        engine.close()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
