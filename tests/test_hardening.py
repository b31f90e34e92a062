"""Issue 18, the CLI / convert / load items. Every expected failure is one line on stderr and
exit code 2, without usage text or a traceback."""

import pytest

from edge0.cli import VERBS
from edge0.cli import main as cli_main
from tests.test_errors import assert_one_line_error


def run_verb(capsys, *argv):
    """`edge0 ARGV` in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli_main(list(argv))
    return e.value.code, capsys.readouterr().err.strip()


# -- 3. flag values ------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["generate", "chat"])
@pytest.mark.parametrize("flags, needle", [
    (["--seed=-1"], "--seed -1"),
    (["--seed", str(2**64)], f"--seed {2**64}"),
    (["--temp", "-1"], "--temp -1"),
    (["--temp", "nan"], "--temp nan"),
    (["--temp", "inf"], "--temp inf"),
    (["--top-p", "5"], "--top-p 5"),
    (["--top-p", "0"], "--top-p 0"),
    (["--top-p", "nan"], "--top-p nan"),
    (["--max-tokens", "-5"], "--max-tokens -5"),
    (["--max-tokens", "x"], "--max-tokens"),
])
def test_sampling_flags_out_of_range(capsys, store_for, verb, flags, needle):
    args = [verb, "--model", str(store_for("qwen3_moe")), *flags] + (["--prompt", "hi"] if verb == "generate" else [])
    assert_one_line_error(*run_verb(capsys, *args), needle)


@pytest.mark.parametrize("verb", ["generate", "serve"])
@pytest.mark.parametrize("k", ["0", "-1", "3", "999"])
def test_top_k_out_of_range(capsys, store_for, verb, k):
    args = [verb, "--model", str(store_for("qwen3_moe")), "--top-k", k] + (["--prompt", "hi"] if verb == "generate" else [])
    code, err = run_verb(capsys, *args)
    assert_one_line_error(code, err, f"--top-k {k}")
    if int(k) > 0:
        assert "use 1..2" in err


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_usage_errors_are_one_line(capsys, verb):
    code, err = run_verb(capsys, verb, "--no-such-flag")
    assert_one_line_error(code, err, f"edge0 {verb}: error: ")
