"""Images on all three APIs (issue 51, item 4's refusal): coding agents send screenshots as Chat
Completions `image_url` parts, Anthropic `image` blocks (in a message or a tool's result) and
Responses `input_image` parts. To a model without a vision tower each is a 400 that says this
model does not take images, names the model and the field, streamed and not; the same
conversation without the image is served. Through the official clients, against the fake engine
(a VL store's images are served: test_server_vision.py)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from edge0.server.config import ServerConfig
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
DATA_URL = f"data:image/png;base64,{PNG}"
SAID = "fake-moe: this model does not take images (fake: its store holds no vision tower"


@pytest.fixture(scope="module")
def base():
    with running_server(FakeEngine(), ServerConfig()) as url:
        yield url


def openai_client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)


def refused(call, error=openai.BadRequestError):
    with pytest.raises(error) as e:
        call()
    body = e.value.body if isinstance(e.value.body, dict) else {}
    return body.get("error", body)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_image_parts_are_refused_naming_the_model_and_the_part(base, stream):
    client = openai_client(base)
    content = [
        {"type": "text", "text": "what is in this screenshot?"},
        {"type": "image_url", "image_url": {"url": DATA_URL}},
    ]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    err = refused(
        lambda: (
            list(
                client.chat.completions.create(
                    model="m", messages=messages + [{"role": "user", "content": content}], max_tokens=4, stream=stream
                )
            )
            if stream
            else client.chat.completions.create(
                model="m", messages=messages + [{"role": "user", "content": content}], max_tokens=4
            )
        )
    )
    assert SAID in err["message"] and err["param"] == "messages.2.content.1" and err["code"] == "images_unsupported"
    text_only = [{"role": "user", "content": [content[0]]}]
    assert client.chat.completions.create(model="m", messages=text_only, max_tokens=4).choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "where, param",
    [
        ("message", "messages.0.content.1"),
        ("tool_result", "messages.2.content.0.content.1"),
    ],
)
def test_anthropic_image_blocks_are_refused_in_a_message_and_in_a_tool_result(base, stream, where, param):
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=30)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    if where == "message":
        messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    else:  # Claude Code's screenshot tool answers with an image in its result
        messages = [
            {"role": "user", "content": "take a screenshot"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "here"}, image],
                    }
                ],
            },
        ]
    body = dict(model="m", max_tokens=4, messages=messages)

    def call():
        if not stream:
            return client.messages.create(**body)
        with client.messages.stream(**body) as s:
            return s.get_final_message()

    err = refused(call, anthropic.BadRequestError)
    assert SAID in err["message"] and f"and {param} is one" in err["message"]
    assert client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}]).content


@pytest.mark.parametrize("stream", [False, True])
def test_responses_input_images_are_refused_in_a_message_and_in_a_function_output(base, stream):
    client = openai_client(base)
    image = {"type": "input_image", "image_url": DATA_URL}
    message = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "what is this?"}, image]}]
    output = [
        {"type": "message", "role": "user", "content": "take a screenshot"},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [image]},
    ]
    for items, param in ((message, "input.0.content.1"), (output, "input.2.output.0")):
        err = refused(
            lambda items=items: (
                list(client.responses.create(model="m", input=items, max_output_tokens=4, stream=True))
                if stream
                else client.responses.create(model="m", input=items, max_output_tokens=4)
            )
        )
        assert SAID in err["message"] and err["param"] == param and err["code"] == "images_unsupported"
    assert client.responses.create(model="m", input="hi", max_output_tokens=4).output_text
