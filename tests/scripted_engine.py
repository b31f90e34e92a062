"""A scripted model in a family's chat format (tests/fixtures/formats): the server's Engine contract
(tests/fake_engine.py) with the case's real tokenizer, as mlx-lm loads it for Edge0, and the
engine's own Reply (end ids, hidden control tokens, stop strings), writing the case's scripted text.

What it writes depends on the rendered prompt: the answer once the call's result is in it, the
call when the request gave tools, else the plain reply."""

from __future__ import annotations

from pathlib import Path

from edge0.backend import io as bio
from edge0.engine.reply import Reply
from edge0.formats import detect
from tests.fake_engine import Call, FakeEngine
from tests.fixtures.formats import RESULT, FormatCase, write_tokenizer


class ScriptedEngine(FakeEngine):
    """FakeEngine with a format case's tokenizer and replies (module docstring)."""

    def __init__(self, case: FormatCase, root: Path):
        super().__init__()
        write_tokenizer(case, root)
        self.case, self.root, self.model_id, self.model_type = case, root, f"{case.name}-fixture", case.name
        self.tokenizer = bio.load_tokenizer(root)
        self.chat_format = detect(self.tokenizer)
        for token in self.chat_format.end_tokens:
            self.tokenizer.add_eos_token(token)
        self.control_ids = bio.control_token_ids(self.tokenizer, self.chat_format.markers())

    def chat_prompt(self, messages, tools=None, **template_kwargs) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        return list(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs, **template_kwargs)
        )

    def reply(self, prompt: list[int]) -> str:
        text = self.tokenizer.decode(prompt)
        if RESULT in text:
            return self.case.answer_reply
        return self.case.call_reply if "get_weather" in text else self.case.plain_reply

    def stream_generate(
        self,
        prompt,
        max_tokens=256,
        temperature=0.0,
        top_p=1.0,
        seed=None,
        stop=None,
        reuse_cache=False,
        should_stop=None,
        top_k=0,
        logits_processors=None,
        logprobs=None,
        cache_namespace="",
    ):
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        call = Call(tokens, dict(max_tokens=max_tokens, stop=stop, cache_namespace=cache_namespace))
        call.prefill_tokens = len(tokens)
        self.calls.append(call)
        script = self.tokenizer.encode(self.reply(tokens), add_special_tokens=False)
        reply = Reply(self.tokenizer, self.control_ids, set(self.tokenizer.eos_token_ids), stop, max_tokens)
        for i, token in enumerate(script):
            step = reply.add(token)
            call.steps = i + 1
            if step.finish_reason:
                call.finish_reason = step.finish_reason
                step.stats = self._stats(call)
            yield step
            if step.finish_reason:
                return
            if should_stop and should_stop():
                call.closed_early = True
                return
        raise AssertionError(f"the {self.case.name} script ran out without an end of turn: {self.reply(tokens)!r}")
