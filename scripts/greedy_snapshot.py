"""Greedy tokens of the bundled model and of every fixture family, per executor, as JSON.

Run it before and after a change and diff the two files: a refactor must not move a token.

    python scripts/greedy_snapshot.py --out /tmp/before.json
    python scripts/greedy_snapshot.py --out /tmp/after.json && diff /tmp/before.json /tmp/after.json

Stores are converted with the `edge0 convert` verb (a stable interface across refactors) into
--work (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edge0  # noqa: E402
from tests.fixtures.families import SPECD, UNIVERSAL  # noqa: E402
from tests.fixtures.make import fixture_dir, reference_dir  # noqa: E402

PROMPT = "hello world, once upon a time there was a tiny model that"
EXECUTORS = [("whole", "staged"), ("exact", "exact"), ("whole", "hot")]


def convert(src: Path, out: Path) -> Path:
    if not out.exists():
        subprocess.run(
            [sys.executable, "-m", "edge0", "convert", "--hf-path", str(src), "-o", str(out)],
            check=True,
            capture_output=True,
        )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="edge0-snapshot-"))
    work.mkdir(parents=True, exist_ok=True)
    result = {}
    for family in SPECD + UNIVERSAL:
        for source, src in (("hf", fixture_dir(family)), ("mlx", reference_dir(family))):
            store = convert(src, work / f"{family}-{source}")
            for prefill, decode in EXECUTORS:
                engine = edge0.load(str(store), dtype="float32", prefill_executor=prefill, decode_executor=decode)
                prompt = engine.tokenizer.encode(PROMPT)
                got = engine.generate(prompt, max_tokens=args.tokens, ignore_eos=True)
                result[f"{family}/{source}/{prefill}+{decode}"] = got.tokens
                print(family, source, prefill, decode, got.tokens[:8], file=sys.stderr)
    bundled = edge0.load()
    result["bundled/default"] = bundled.generate(bundled.tokenizer.encode("The Python tutorial"), max_tokens=40).tokens
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{len(result)} cases -> {args.out}")


if __name__ == "__main__":
    main()
