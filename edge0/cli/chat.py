"""`edge0 chat`: chat in the terminal, with streamed replies and the KV cache reused across turns.

Replies go to stdout; the per-reply stats line and notices go to stderr, so a script that pipes
lines into stdin reads only the replies from stdout. Commands: /reset, /stats, /exit.
"""

from __future__ import annotations

import sys

from edge0.cli.common import (
    OneLineParser,
    add_model_options,
    add_sampling_options,
    check_sampling_options,
    format_rank_stats,
    format_speculation,
    load_or_follow,
    run_main,
)
from edge0.engine.engine import TemplateFailed
from edge0.errors import Edge0Error

COMMANDS = "/reset (forget the conversation), /stats (engine statistics), /exit"


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def stats_line(s: dict) -> str:
    """The one line printed after each reply: speed, reused KV, peak memory, expert-cache hits."""
    reused = s["prompt_tokens"] - s["prefill_tokens"]
    hit = "off" if s.get("expert_hit_rate") is None else f"{100 * s['expert_hit_rate']:.1f}%"
    spec = format_speculation(s).replace(", speculation", " | speculation", 1)
    return (
        f"[{s['decode_tps']:.1f} tok/s, {s['generation_tokens']} tokens | prefill {s['prefill_tokens']} "
        f"of {s['prompt_tokens']} prompt tokens ({reused} reused) | peak memory "
        f"{_size(s['peak_memory_bytes'])} | expert cache hit {hit}{spec}]"
    )


class Session:
    """One conversation: the message history and the engine whose KV cache holds it."""

    def __init__(self, engine, args):
        self.engine, self.args = engine, args
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.history = list(self.system)
        self.last_stats: dict | None = None

    def reset(self) -> None:
        self.history = list(self.system)
        self.engine.reset_cache()

    def reply(self, text: str) -> None:
        """Stream the assistant's answer to `text`; Ctrl-C ends it early and keeps the session."""
        user = {"role": "user", "content": text}
        parts, stats = [], None
        try:
            # The whole history goes in; with reuse_cache the engine prefills only what is new.
            try:
                prompt = self.engine.chat_prompt(self.history + [user])
            except TemplateFailed as e:
                raise Edge0Error(
                    f"{self.engine.template_file()}: {e}; the template is at fault: fix it there"
                ) from None
            steps = self.engine.stream_generate(
                prompt,
                max_tokens=self.args.max_tokens,
                temperature=self.args.temp,
                top_p=self.args.top_p,
                seed=self.args.seed,
                reuse_cache=True,
            )
            try:
                for step in steps:
                    sys.stdout.write(step.text)
                    sys.stdout.flush()
                    parts.append(step.text)
                    stats = step.stats
            finally:
                steps.close()
        except KeyboardInterrupt:
            if self.engine.pipeline is not None:  # mlx.launch stops every rank on Ctrl-C: so does rank 0
                raise
            # Ctrl-C can land between a KV update and the engine's note of it; start clean.
            self.engine.reset_cache()
            print("\n[interrupted]", file=sys.stderr, flush=True)
        print(flush=True)
        # A partial reply stays in the history: the user saw it, and it is what the KV cache holds.
        self.history += [user, {"role": "assistant", "content": "".join(parts)}]
        if stats:
            self.last_stats = stats
            print(stats_line(stats), file=sys.stderr, flush=True)

    def print_stats(self) -> None:
        turns = sum(m["role"] == "user" for m in self.history)
        print(f"turns: {turns}, messages: {len(self.history)}")
        if self.last_stats:
            print("last reply: " + stats_line(self.last_stats))
        stats = self.engine.stats()
        if "ranks" in stats:
            print(format_rank_stats(stats))
        for key, value in stats.items():
            if key == "ranks":
                continue
            if not isinstance(value, dict):
                print(f"{key}: {value}")
            elif not any(isinstance(v, dict) for v in value.values()):  # skip per-layer tables
                print(f"{key}: " + ", ".join(f"{k} {v}" for k, v in value.items()))


def _read_line(interactive: bool) -> str | None:
    """The next input line, or None at end of input."""
    if not interactive:
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None
    while True:
        try:
            return input(">> ")
        except EOFError:
            print()
            return None
        except KeyboardInterrupt:  # like a shell: Ctrl-C at the prompt clears the line
            print()


def _is_utf8(text: str) -> bool:
    """False for lines whose bytes were not UTF-8 (Python reads them as lone surrogates, which
    the tokenizer rejects)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def repl(session: Session) -> None:
    """Read lines until /exit or end of input; everything that is not a command is a user turn."""
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"edge0 chat with {session.engine.model_id}. Commands: {COMMANDS}. Ctrl-C stops a reply.")
    while (line := _read_line(interactive)) is not None:
        text = line.strip()
        if not text:
            continue
        if not _is_utf8(text):
            print("[not UTF-8 text; line skipped]", file=sys.stderr, flush=True)
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            session.reset()
            print("[conversation reset]", file=sys.stderr, flush=True)
        elif text == "/stats":
            session.print_stats()
        elif text.startswith("/") and " " not in text:
            print(f"[unknown command {text}; commands: {COMMANDS}]", file=sys.stderr, flush=True)
        else:
            session.reply(text)


def main(argv=None) -> int:
    p = OneLineParser(prog="edge0 chat", description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_options(p, 512, "reply")
    args = p.parse_args(argv)
    check_sampling_options(p, args)

    engine = load_or_follow(args)
    if engine is None:  # under mlx.launch: this rank ran its layers of rank 0's work
        return 0
    try:
        repl(Session(engine, args))
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    run_main(main)
