"""Images through all three APIs (issue 51) on a VL store, with the official clients against the real
server and engine: Chat Completions `image_url` data URLs, Anthropic base64 `image` blocks (in a
message and in a tool's result) and Responses `input_image` parts, streamed and not, reply and prompt
token count as the engine gives them alone (and the engine's equal mlx-vlm's: test_vision.py); a
conversation extended after its image reuses its prefix; bad images are a 400 naming the field."""

from __future__ import annotations

import base64
import io
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("mlx_vlm")

import anthropic  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402

import edge0  # noqa: E402
from edge0.server.config import ServerConfig  # noqa: E402
from tests.fake_server import running_server  # noqa: E402
from tests.fixtures.vision import random_image  # noqa: E402
from tests.test_vision import vl_store  # noqa: E402

QUESTION = "Describe the image."
N = 8
FAMILIES = ["qwen3_vl_moe", "qwen3_5_moe", "llama4"]
EXECUTORS = ["staged", "exact", "hot"]
# the default run: one family with the default executor; -m slow runs every family with every executor
MATRIX = [
    pytest.param((f, e), id=f"{f}-{e}", marks=() if (f, e) == ("qwen3_vl_moe", "staged") else pytest.mark.slow)
    for f in FAMILIES
    for e in EXECUTORS
]


@pytest.fixture(scope="module", params=MATRIX)
def served(request):
    family, executor = request.param
    engine = edge0.load(vl_store(family), decode_executor=executor)
    with running_server(engine, ServerConfig()) as url:
        yield engine, url
    engine.close()


def _alone(engine, images: list[bytes], messages) -> tuple[str, int]:
    """The engine's own reply (text, prompt tokens) to `messages` with `images`, no prompt caches."""
    ids = engine.chat_prompt(messages)
    out = engine.generate(ids, N, images=images)
    return out.text, out.stats["prompt_tokens"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _user_turn(engine) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


# (role, images, text) turns: one image, two images, three turns with the image in the first
VARIANTS = {
    "one-image": lambda: [("user", [random_image(11)], QUESTION)],
    "two-images": lambda: [("user", [random_image(12, 96, 64), random_image(13)], QUESTION)],
    "three-turns": lambda: [
        ("user", [random_image(14)], QUESTION),
        ("assistant", [], "It is a picture of noise."),
        ("user", [], "What colour is it mostly?"),
    ],
}


def _template(turns) -> list[dict]:
    return [
        {"role": r, "content": [*({"type": "image"} for _ in imgs), {"type": "text", "text": t}] if imgs else t}
        for r, imgs, t in turns
    ]


def _chat(turns) -> list[dict]:
    def url(img):
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(img)}"}}

    return [
        {"role": r, "content": [*map(url, imgs), {"type": "text", "text": t}] if imgs else t} for r, imgs, t in turns
    ]


def _anthropic(turns) -> list[dict]:
    def block(img):
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(img)}}

    return [
        {"role": r, "content": [*map(block, imgs), {"type": "text", "text": t}] if imgs else t} for r, imgs, t in turns
    ]


def _responses(turns) -> list[dict]:
    def part(img):
        return {"type": "input_image", "image_url": f"data:image/png;base64,{_b64(img)}"}

    return [
        {"role": r, "content": [*map(part, imgs), {"type": "input_text", "text": t}] if imgs else t}
        for r, imgs, t in turns
    ]


def _want(engine, turns) -> tuple[str, int]:
    return _alone(engine, [img for _, imgs, _ in turns for img in imgs], _template(turns))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_image_url_parts(served, stream, variant):
    engine, url = served
    turns = VARIANTS[variant]()
    want, prompt_tokens = _want(engine, turns)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    args = dict(model="m", messages=_chat(turns), max_tokens=N, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(**args)
        text, usage = reply.choices[0].message.content or "", reply.usage
    assert text == want
    assert usage.prompt_tokens == prompt_tokens


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_image_blocks(served, stream, variant):
    engine, url = served
    turns = VARIANTS[variant]()
    want, prompt_tokens = _want(engine, turns)
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
    args = dict(model="m", max_tokens=N, messages=_anthropic(turns), extra_body={"temperature": 0})
    if stream:
        with client.messages.stream(**args) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
    else:
        final = client.messages.create(**args)
        text = "".join(b.text for b in final.content if b.type == "text")
    assert text == want
    u = final.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0) == prompt_tokens


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("stream", [False, True])
def test_responses_input_image_parts(served, stream, variant):
    engine, url = served
    turns = VARIANTS[variant]()
    want, prompt_tokens = _want(engine, turns)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    args = dict(model="m", input=_responses(turns), max_output_tokens=N, temperature=0)
    if stream:
        events = list(client.responses.create(**args, stream=True))
        response = next(e.response for e in events if e.type in ("response.completed", "response.incomplete"))
    else:
        response = client.responses.create(**args)
    assert response.output_text == want
    assert response.usage.input_tokens == prompt_tokens


def test_an_image_in_a_tool_result_reaches_the_model(served):
    """Claude Code's screenshot tool answers with an image inside its tool_result: the image is
    rendered in the tool message, as the engine renders it alone."""
    engine, url = served
    image = random_image(15)
    messages = [
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [
                        {"type": "text", "text": "here"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(image)}},
                    ],
                }
            ],
        },
    ]
    tools = [{"name": "shot", "description": "a screenshot", "input_schema": {"type": "object"}}]
    template = [
        {"role": "user", "content": "take a screenshot"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "shot", "arguments": {}}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "here"}, {"type": "image"}]},
    ]
    tool_dicts = [
        {
            "type": "function",
            "function": {"name": "shot", "description": "a screenshot", "parameters": {"type": "object"}},
        }
    ]
    ids = engine.chat_prompt(template, tool_dicts)
    want = engine.generate(ids, N, images=[image])
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
    final = client.messages.create(
        model="m", max_tokens=N, messages=messages, tools=tools, extra_body={"temperature": 0}
    )
    u = final.usage
    assert (
        u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
        == want.stats["prompt_tokens"]
    )


def test_a_conversation_extended_after_its_image_reuses_the_prefix(served):
    engine, url = served
    image = random_image(14)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    first = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(image)}"}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    reply = client.chat.completions.create(model="m", messages=first, max_tokens=N, temperature=0)
    turn = first + [
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": "And the colours?"},
    ]
    again = client.chat.completions.create(model="m", messages=turn, max_tokens=N, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > reply.usage.prompt_tokens // 2
    want, prompt_tokens = _alone(
        engine,
        [image],
        _user_turn(engine)
        + [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": "And the colours?"},
        ],
    )
    assert (again.choices[0].message.content or "") == want and again.usage.prompt_tokens == prompt_tokens


def _zero_png() -> bytes:
    """A PNG whose header says 0 by 0 pixels (no encoder writes one: built by hand)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    "url, param, says",
    [
        ("data:image/png;base64," + _b64(b"not a png at all"), "messages.0.content.0", "not a readable image"),
        ("data:image/png;base64," + _b64(_png(20000, 8)), "messages.0.content.0", "each side must be 1 to 8192"),
        ("data:image/png;base64," + _b64(_zero_png()), "messages.0.content.0", "image 1:"),
        ("data:image/tiff;base64," + _b64(b"II*\0"), "messages.0.content.0", "media type 'image/tiff'"),
        ("https://example.com/cat.png", "messages.0.content.0", "image links are not fetched"),
        ("data:image/png;base64,@@@", "messages.0.content.0", "not valid base64"),
    ],
)
def test_bad_images_are_a_400_naming_the_part(served, url, param, says):
    _, base = served
    body = {
        "model": "m",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
    }
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["param"] == param


def test_an_anthropic_url_source_and_too_many_images_are_refused(served):
    _, base = served
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    r = httpx.post(
        base + "/v1/messages",
        json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]},
        timeout=60,
    )
    assert r.status_code == 400 and "not fetched" in r.json()["error"]["message"]
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(random_image(1))}}
    r = httpx.post(
        base + "/v1/chat/completions",
        json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [part] * 17}]},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images"


@pytest.mark.slow  # 10-20 s of node start-up; the default run has a real-client test already (test_server_clients)
def test_claude_code_sends_a_pasted_image_and_gets_a_reply(tmp_path):
    """Claude Code (the real client, print mode with a stream-json user message: what a pasted
    screenshot becomes) against a server on the VL fixture: its request carries the image block, the
    engine decodes it, and the client prints the model's reply. The fixture's random weights may not
    end a reply: one cut at the server's 16-token cap Claude Code reports as an error after retrying,
    so the replies it printed are what is checked, not its exit status."""
    import json

    from tests.agent_clients import run_client
    from tests.test_server_clients import _client_problem

    if problem := _client_problem("claude"):
        pytest.skip(problem)
    store = vl_store()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(random_image(31))}}
    message = {"type": "user", "message": {"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}}
    # no tools and a short system prompt: Claude Code's own (70,000 tokens) would take minutes to
    # prefill on this CPU with the real engine, and is not what is tested here
    small = ["--tools", "", "--system-prompt", "You are a helpful assistant."]
    result = run_client("claude", json.dumps(message), tmp_path, extra=small, store=str(store))
    sent = [
        r
        for r in result["requests"]
        if r["path"] == "/v1/messages" and "image" in json.dumps(r["body"].get("messages", [])[-1:])
    ]
    assert sent, result["stderr"][-2000:] or "no request carried the image"
    printed = [json.loads(line) for line in result["stdout"].splitlines() if line.startswith("{")]
    replies = [
        block["text"]
        for m in printed
        if m["type"] == "assistant" and m["message"]["model"] == store.name
        for block in m["message"]["content"]
        if block["type"] == "text"
    ]
    assert replies and all(replies), printed[-1]
    # its result: the reply, or (a reply cut by the 16-token cap) Claude Code's words for that; never a refusal
    assert printed[-1]["result"] in replies or "exceeded" in printed[-1]["result"], printed[-1]


def test_image_links_are_fetched_only_with_the_flag(served):
    """--fetch-image-urls: a Chat Completions link and an Anthropic url source are fetched (here from
    a local server) and answered as the same image sent as data; a page that is not an image, a
    missing one and an oversized one are 400s naming the part. Without the flag: the 400 says so."""
    import http.server
    import threading

    from edge0.server import images

    engine, url = served
    picture = random_image(16)
    pages = {"/a.png": ("image/png", picture), "/page": ("text/html", b"<html></html>")}

    class Pages(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            kind, body = pages.get(self.path, (None, b""))
            self.send_response(200 if kind else 404)
            if kind:
                self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    link = f"http://127.0.0.1:{site.server_address[1]}"
    want, prompt_tokens = _want(engine, [("user", [picture], QUESTION)])

    def chat(base, image_url):
        content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": QUESTION}]
        body = {"model": "m", "max_tokens": N, "temperature": 0, "messages": [{"role": "user", "content": content}]}
        return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)

    try:
        refused = chat(url, link + "/a.png")
        assert refused.status_code == 400 and "--fetch-image-urls" in refused.json()["error"]["message"]
        with running_server(engine, ServerConfig(fetch_image_urls=True)) as base:
            r = chat(base, link + "/a.png")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want
            assert r.json()["usage"]["prompt_tokens"] == prompt_tokens
            block = {"type": "image", "source": {"type": "url", "url": link + "/a.png"}}
            m = httpx.post(
                base + "/v1/messages",
                json={
                    "model": "m",
                    "max_tokens": N,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}],
                },
                timeout=60,
            )
            assert m.status_code == 200 and m.json()["content"][0]["text"] == want, m.text
            for path, says in (("/page", "text/html"), ("/gone.png", "HTTP 404")):
                bad = chat(base, link + path)
                assert bad.status_code == 400 and says in bad.json()["error"]["message"]
                assert bad.json()["error"]["param"] == "messages.0.content.0"
            pages["/big.png"] = ("image/png", b"\0" * (images.MAX_IMAGE_BYTES + 1))
            big = chat(base, link + "/big.png")
            assert big.status_code == 400 and "over 20 MB" in big.json()["error"]["message"]
    finally:
        site.shutdown()
