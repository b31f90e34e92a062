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
from tests.test_vision import _mlx_vlm_4bit  # noqa: E402

QUESTION = "Describe the image."
N = 8


@pytest.fixture(scope="module")
def served():
    from edge0.store.convert import convert
    from tests.fixtures.make import cached_dir

    src = _mlx_vlm_4bit()
    store = cached_dir("store", "vl-from-mlx-vlm", lambda out: convert(src, out, quiet=True))
    engine = edge0.load(store)
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


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_image_url_parts(served, stream):
    engine, url = served
    image = random_image(11)
    want, prompt_tokens = _alone(engine, [image], _user_turn(engine))
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(image)}"}},
        {"type": "text", "text": QUESTION},
    ]
    args = dict(model="m", messages=[{"role": "user", "content": content}], max_tokens=N, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(**args)
        text, usage = reply.choices[0].message.content or "", reply.usage
    assert text == want
    assert usage.prompt_tokens == prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_image_blocks(served, stream):
    engine, url = served
    image = random_image(12)
    want, prompt_tokens = _alone(engine, [image], _user_turn(engine))
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(image)}}
    args = dict(
        model="m",
        max_tokens=N,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}],
        extra_body={"temperature": 0},
    )
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


@pytest.mark.parametrize("stream", [False, True])
def test_responses_input_image_parts(served, stream):
    engine, url = served
    image = random_image(13)
    want, prompt_tokens = _alone(engine, [image], _user_turn(engine))
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    item = {
        "role": "user",
        "content": [
            {"type": "input_image", "image_url": f"data:image/png;base64,{_b64(image)}"},
            {"type": "input_text", "text": QUESTION},
        ],
    }
    args = dict(model="m", input=[item], max_output_tokens=N, temperature=0)
    if stream:
        events = list(client.responses.create(**args, stream=True))
        response = next(e.response for e in events if e.type in ("response.completed", "response.incomplete"))
    else:
        response = client.responses.create(**args)
    assert response.output_text == want
    assert response.usage.input_tokens == prompt_tokens


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
