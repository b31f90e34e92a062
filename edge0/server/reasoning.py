"""Reasoning around a generation: whether the prompt opened a reasoning block, and the thinking
budget. The markers are the chat format's (edge0/formats: `<think>` and `</think>` for Qwen3-style
models); the template's thinking switch (`enable_thinking`) leaves the reasoning out (an empty
`<think></think>` in the prompt). Splitting reasoning out of the reply is the format's splitter.
"""

from __future__ import annotations

from edge0.backend.logits import only_token

OPEN_TAIL_TOKENS = 32  # a template opens the block in its generation prompt, at the very end


def opens_reasoning(fmt, tokenizer, prompt: list[int]) -> bool:
    """The prompt ends inside a reasoning block of the chat format `fmt` (its template opened one
    for the model): in its last tokens (a generation prompt), the last start marker comes after
    the last end marker."""
    found = fmt.think
    if not found:
        return False
    tail = tokenizer.decode(prompt[-OPEN_TAIL_TOKENS:])
    return tail.rfind(found[0]) > tail.rfind(found[1])


class ThinkingBudget:
    """A logits processor ending the reasoning block once it holds `budget` tokens: the next
    token is then think_end (Anthropic's thinking.budget_tokens). Needs single-token markers."""

    def __init__(self, start_id: int, end_id: int, budget: int, inside: bool):
        self.start_id, self.end_id, self.budget = start_id, end_id, budget
        self.inside, self.spent, self.seen = inside, 0, 0
        self.forced = 0  # blocks ended by the budget

    def __call__(self, generated: list[int], logprobs):
        for token in generated[self.seen :]:
            if token == self.start_id:
                self.inside = True
            elif token == self.end_id:
                self.inside = False
            elif self.inside:
                self.spent += 1
        self.seen = len(generated)
        if self.inside and self.spent >= self.budget:
            self.forced += 1
            return only_token(logprobs, self.end_id)
        return logprobs


def budget(fmt, tokenizer, budget_tokens: int, inside: bool) -> ThinkingBudget | None:
    """The budget processor, or None when a marker of the chat format `fmt` is not one token (the
    budget is then not enforced; max_tokens still bounds the whole reply)."""
    found = fmt.think
    ids = [tokenizer.encode(m, add_special_tokens=False) for m in found] if found else []
    if len(ids) != 2 or any(len(i) != 1 for i in ids):
        return None
    return ThinkingBudget(ids[0][0], ids[1][0], budget_tokens, inside)
