"""A reply ends where mlx-lm's `generate` ends, on the real engine: a tiny model of the family
(tests/fixtures) given the format case's tokenizer, template and end ids (tests/fixtures/formats),
converted to a store; both are forced through the case's plain reply, which runs past the end of
its turn (GLM's <|user|>, listed as an end id only in config.json and generation_config.json), and
must stop at the same token with the same text."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest

import edge0
from edge0.store.convert import convert
from tests.fixtures.formats import build_tokenizer, cases, write_tokenizer
from tests.fixtures.make import fixture_dir

# GLM's and gpt-oss's in the default run (end ids only their config files list); every case with a
# family under -m slow (a store is converted for each).
CHECKED = [
    pytest.param(c, marks=() if c.name in ("glm47", "harmony") else pytest.mark.slow) for c in cases() if c.family
]


class Script:
    """A logits processor forcing `tokens` in order; `prompt_len`: mlx-lm passes the prompt and
    the generated tokens, edge0 the generated ones only."""

    def __init__(self, tokens: list[int], prompt_len: int = 0):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, seen, logits):
        from edge0.backend.logits import only_token

        n = len(seen) - self.prompt_len
        return only_token(logits, self.tokens[min(n, len(self.tokens) - 1)])


@pytest.mark.parametrize("reply", ["plain_reply", "call_reply"])
@pytest.mark.parametrize("case", CHECKED, ids=lambda c: getattr(c, "name", None))
def test_a_reply_ends_where_mlx_lm_generate_ends(case, reply, tmp_path):
    """Plain chat, and a call (gpt-oss's <|call|>, GLM's <|observation|>), forced through both."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm import stream_generate

    vocab = build_tokenizer(case).get_vocab_size(with_added_tokens=True)
    src = tmp_path / "hf"
    shutil.copytree(fixture_dir(case.family, vocab_size=vocab), src)

    config = json.loads((src / "config.json").read_text())
    write_tokenizer(case, src, model_config=config)
    with contextlib.redirect_stderr(io.StringIO()):
        store = convert(str(src), tmp_path / "store", quiet=True)
    engine = edge0.load(store, prerouter=False)
    messages = [{"role": "user", "content": "hi"}]
    prompt = engine.chat_prompt(messages)
    script = engine.tokenizer.encode(getattr(case, reply), add_special_tokens=False)
    ours = engine.generate(prompt, max_tokens=len(script), logits_processors=[Script(script)])

    model, tokenizer = mlx_lm_load(str(src))
    theirs = list(
        stream_generate(
            model, tokenizer, prompt, max_tokens=len(script), logits_processors=[Script(script, len(prompt))]
        )
    )
    their_tokens = [r.token for r in theirs]
    assert ours.tokens == their_tokens  # the same tokens, the end id last
    assert ours.tokens[-1] in engine.tokenizer.eos_token_ids and len(ours.tokens) < len(script)
    assert ours.text.strip() == "".join(r.text for r in theirs).strip()
    if reply == "plain_reply":
        assert case.plain_text in ours.text
