"""The long-context fixture of the agent-session measurements: the tests' tiny qwen3_moe checkpoint
(tests/fixtures/make.py) with a 131,072-token context, as an edge0 store and as mlx-lm's own
`convert -q` output of the same weights, in DIR/store and DIR/mlx (the layout scripts/bench_session.py
and `edge0 bench --concurrency 1 --long-prompt N --model DIR` take; docs/bench-suite.md).

    python scripts/make_session_fixture.py DIR
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge0.store.convert import convert  # noqa: E402
from tests.fixtures.make import make_hf_fixture, make_mlx_reference  # noqa: E402

CONTEXT = 131_072


def main(argv=None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        sys.exit(__doc__.strip())
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    hf = out / "hf"
    if not hf.exists():
        make_hf_fixture("qwen3_moe", hf, max_position_embeddings=CONTEXT)
    with contextlib.redirect_stderr(io.StringIO()):
        if not (out / "store").exists():
            convert(str(hf), out / "store", quiet=True)
        if not (out / "mlx").exists():
            make_mlx_reference(hf, out / "mlx")
    print(out)


if __name__ == "__main__":
    main()
