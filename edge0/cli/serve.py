"""`edge0 serve`: an OpenAI- and Anthropic-compatible HTTP server (see docs/server.md)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os

from edge0.backend.memory import available as memory_available
from edge0.cli.common import OneLineParser, add_model_options, load_or_follow, run_main
from edge0.errors import Edge0Error
from edge0.server.memory import DEFAULT_POLL_S, MemoryWatcher, default_memory_low
from edge0.units import format_size, parse_size

log = logging.getLogger("edge0.server")


def _count(minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _size(flag: str):
    def parse(text: str) -> int:
        try:
            return parse_size(text, flag)
        except Edge0Error as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _checked(normalize: str):
    """An argparse type from a hosts.py normalizer (imported when a flag is given)."""

    def parse(text: str) -> str:
        from edge0.server import hosts

        try:
            return getattr(hosts, normalize)(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _api_keys(p: argparse.ArgumentParser, keys: list[str] | None) -> tuple[str, ...]:
    """The --api-key values, else $EDGE0_API_KEY, else none; each checked (_check_api_key)."""
    if keys is None:
        env = os.environ.get("EDGE0_API_KEY")
        keys = [env] if env is not None else []
    for key in keys:
        _check_api_key(p, key)
    return tuple(dict.fromkeys(keys))


def _check_api_key(p: argparse.ArgumentParser, key: str) -> None:
    """An empty key (often an unset shell variable: --api-key "$KEY") would turn auth off, and one
    outside printable ASCII can never match (HTTP header values are ASCII): both are usage errors.
    The key itself is never printed."""
    if not key:
        p.error(
            "--api-key (or $EDGE0_API_KEY) is empty, which would serve without a key; give a key, or leave out "
            "--api-key and unset EDGE0_API_KEY to serve without one"
        )
    if not all("!" <= c <= "~" for c in key):
        p.error(
            "--api-key (or $EDGE0_API_KEY) holds a space or a character outside printable ASCII, which no "
            "client can send in an HTTP header; choose a key of letters, digits and punctuation"
        )


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="edge0 serve", description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_count(0, 65535), default=8080, help="port, 0 to 65535 (default 8080)")
    p.add_argument(
        "--api-key",
        action="append",
        help="require the key on /v1/*, as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
        "(default: $EDGE0_API_KEY, else none); repeat it for several clients, whose requests then never "
        "share cached prompts",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        type=_checked("normalize_host"),
        metavar="NAME",
        help="also answer requests whose Host header is NAME, e.g. a name this machine has on the network "
        "(repeatable; default: only localhost, 127.0.0.1, [::1] and the bound address, against DNS rebinding)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        type=_checked("normalize_origin"),
        metavar="ORIGIN",
        help="let web pages of ORIGIN (scheme://host[:port]) call the server from a browser (repeatable; "
        "default: none, only the server's own page at /)",
    )
    p.add_argument(
        "--max-queue",
        type=_count(0),
        default=16,
        help="requests that may wait behind the running ones; more get 429 (default 16)",
    )
    p.add_argument(
        "--max-batch",
        type=_count(1),
        default=None,
        help="requests decoded together, joining and leaving between steps (default: from memory, each one "
        "beyond the first holding a context's KV out of --prompt-cache-memory, at most 8; 1 with the pre-router "
        "or --draft, which follow one sequence)",
    )
    p.add_argument("--max-body-bytes", type=_count(1), default=4 << 20, help="request body limit (default 4 MiB)")
    p.add_argument(
        "--max-tokens",
        type=_count(1),
        default=None,
        help="most tokens one request generates; a larger max_tokens is clamped to it (default: what the model's "
        "context leaves after the prompt)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=_count(1),
        default=None,
        help="max_tokens for a request that gives none (default 4096, at most --max-tokens); a request's own "
        "max_tokens is used as given, up to --max-tokens",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="the model id to report (the first) and names it answers to (repeatable; default: the store's "
        "directory name). Any requested name is accepted unless --strict-model-name",
    )
    p.add_argument(
        "--strict-model-name",
        action="store_true",
        help="answer only requests naming a served model name (others get 404)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=_count(1),
        default=None,
        help="prompt length limit in tokens (default: the model's context length, max_position_embeddings)",
    )
    p.add_argument("--max-messages", type=_count(1), default=512, help="messages per chat request (default 512)")
    p.add_argument(
        "--fetch-image-urls",
        action="store_true",
        help="fetch images given by http(s) links (the server reaches any host a client names: only with "
        "trusted clients); by default a link is a 400 and clients send the image itself",
    )
    p.add_argument(
        "--memory-low",
        type=_size("--memory-low"),
        default=None,
        metavar="SIZE",
        help="shrink the expert cache between requests while less memory than this is available, grow "
        "it back when memory is free (default: 10%% of the memory available at start, at most 2GB; "
        "0: off)",
    )
    p.add_argument(
        "--memory-poll-s",
        type=_seconds,
        default=DEFAULT_POLL_S,
        help=f"seconds between memory readings (default {DEFAULT_POLL_S:g})",
    )
    p.add_argument(
        "--no-prompt-cache-dir",
        action="store_true",
        help="keep no KV caches on disk (default for serve: --prompt-cache-dir is the edge0 cache directory's "
        "prompt-caches/, so a conversation evicted from memory or a restarted server resumes its prefix)",
    )
    add_connection_options(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def add_connection_options(p: argparse.ArgumentParser) -> None:
    """The connection limits (server/connections.py); defaults from ServerConfig."""
    from edge0.server.config import ServerConfig

    d = ServerConfig()
    p.add_argument(
        "--max-connections",
        type=_count(1),
        default=d.max_connections,
        help="open connections; past it the oldest idle one is closed, and a new one is refused when all are "
        f"busy (default {d.max_connections}; the descriptor limit is raised to fit)",
    )
    for flag, default, what in (
        ("--header-timeout-s", d.header_timeout_s, "for a request's headers to arrive"),
        ("--body-timeout-s", d.body_timeout_s, "for a request's body to arrive once its headers are in (408)"),
        ("--idle-timeout-s", d.idle_timeout_s, "a connection stays open between requests (keep-alive)"),
    ):
        p.add_argument(flag, type=_seconds, default=default, help=f"seconds {what} (default {default:g})")


def _watch_memory(memory_low: int, poll_s: float):
    """For a rank other than 0: its own expert cache shrinks under memory pressure (and grows back),
    between generations, as one process's does (server/memory.py)."""
    if not memory_low:
        return None

    def watch(engine):
        MemoryWatcher(engine, memory_low, poll_s).start(engine.pipeline.run_between)

    return watch


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.default_max_tokens and args.max_tokens and args.default_max_tokens > args.max_tokens:
        p.error("--default-max-tokens must not exceed --max-tokens")
    if any(not name.strip() for name in args.served_model_name):
        p.error("--served-model-name must not be empty")
    if args.no_prompt_cache_dir and args.prompt_cache_dir:
        p.error("--no-prompt-cache-dir and --prompt-cache-dir contradict each other; drop one")
    if not args.no_prompt_cache_dir and args.prompt_cache_dir is None:
        from edge0.store.bundled import cache_dir

        args.prompt_cache_dir = str(cache_dir() / "prompt-caches")
    args.api_key = _api_keys(p, args.api_key)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    if not _is_loopback(args.host):
        log.warning(
            "binding to %s: the server is reachable from other machines%s",
            args.host,
            "" if args.api_key else ", and without --api-key anyone who reaches it can use it",
        )

    from edge0.server.app import create_app, run
    from edge0.server.clients import agent_warnings, setup_lines
    from edge0.server.config import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_TOKENS, ServerConfig, model_context_length

    memory_low = args.memory_low
    if memory_low is None:  # before loading: the model's own memory is not "pressure"
        memory_low = default_memory_low(memory_available()[0])
    engine = load_or_follow(args, before_follow=_watch_memory(memory_low, args.memory_poll_s))
    if engine is None:  # under mlx.launch: this rank ran its layers of rank 0's work
        return 0
    context = model_context_length(engine.root)
    if context is None:
        log.warning(
            "the model's config.json declares no context length (max_position_embeddings); taking %d tokens "
            "(prompt and generation; --max-prompt-tokens defaults to it)",
            DEFAULT_MAX_PROMPT_TOKENS,
        )
    context = context or DEFAULT_MAX_PROMPT_TOKENS
    max_prompt_tokens = args.max_prompt_tokens or context
    config = ServerConfig(
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        max_body_bytes=args.max_body_bytes,
        max_tokens=args.max_tokens,
        default_max_tokens=args.default_max_tokens or min(DEFAULT_MAX_TOKENS, args.max_tokens or DEFAULT_MAX_TOKENS),
        context_length=context,
        max_prompt_tokens=max_prompt_tokens,
        max_messages=args.max_messages,
        fetch_image_urls=args.fetch_image_urls,
        memory_low=memory_low,
        memory_poll_s=args.memory_poll_s,
        allowed_hosts=tuple(args.allowed_host),
        cors_origins=tuple(args.cors_origin),
        served_model_names=tuple(args.served_model_name),
        strict_model_name=args.strict_model_name,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
    )
    log.info(
        "limits: context %d tokens, prompt %d (--max-prompt-tokens), generation %s (--max-tokens), %d when a "
        "request names none (--default-max-tokens), queue %d (--max-queue); expert cache shrinks below %s "
        "available (--memory-low); connections %d (--max-connections), headers within %gs, bodies within %gs, "
        "idle connections kept %gs",
        config.context_length,
        config.max_prompt_tokens,
        config.max_tokens or "what the context leaves",
        config.default_max_tokens,
        config.max_queue,
        format_size(memory_low) if memory_low else "never",
        config.max_connections,
        config.header_timeout_s,
        config.body_timeout_s,
        config.idle_timeout_s,
    )
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    base = f"http://{f'[{shown}]' if ':' in shown else shown}:{args.port}"
    log.info("chat page: %s/", base)
    model = (config.served_model_names or (engine.model_id,))[0]
    for line in setup_lines(base, model, keyed=bool(args.api_key)):
        log.info("%s", line)
    log.info("%s", engine.chat_format.describe())
    for line in agent_warnings(engine.chat_format.calls, config.context_length):
        log.warning("%s", line)
    try:
        run(create_app(engine, config), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    run_main(main)
