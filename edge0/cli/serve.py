"""`edge0 serve`: an OpenAI-compatible HTTP server (see docs/server.md)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from edge0.cli.common import OneLineParser, add_model_options, load_options, run_main

log = logging.getLogger("edge0.server")


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="edge0 serve", description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_count(0), default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=os.environ.get("EDGE0_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $EDGE0_API_KEY, else none)")
    p.add_argument("--max-queue", type=_count(0), default=16,
                   help="requests that may wait behind the running one; more get 429 (default 16)")
    p.add_argument("--max-body-bytes", type=_count(1), default=4 << 20, help="request body limit (default 4 MiB)")
    p.add_argument("--max-tokens", type=_count(1), default=4096, help="largest max_tokens a request may ask (default 4096)")
    p.add_argument("--default-max-tokens", type=_count(1), default=512,
                   help="max_tokens when a request gives none (default 512)")
    p.add_argument("--max-prompt-tokens", type=_count(1), default=32768, help="prompt length limit (default 32768)")
    p.add_argument("--max-messages", type=_count(1), default=512, help="messages per chat request (default 512)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.default_max_tokens > args.max_tokens:
        p.error("--default-max-tokens must not exceed --max-tokens")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    if not _is_loopback(args.host):
        log.warning("binding to %s: the server is reachable from other machines%s", args.host,
                    "" if args.api_key else ", and without --api-key anyone who reaches it can use it")

    import uvicorn

    import edge0
    from edge0.server.app import create_app
    from edge0.server.config import ServerConfig

    engine = edge0.load(args.model, **load_options(args))
    print(engine.describe(), file=sys.stderr)
    if engine.follower:  # under mlx.launch: rank 0 serves; this rank runs its layers of each request
        engine.follow()
        return 0
    config = ServerConfig(api_key=args.api_key, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                          max_tokens=args.max_tokens, default_max_tokens=args.default_max_tokens,
                          max_prompt_tokens=args.max_prompt_tokens, max_messages=args.max_messages)
    try:
        uvicorn.run(create_app(engine, config), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    run_main(main)
