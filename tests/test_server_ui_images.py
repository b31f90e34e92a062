"""The chat page with images (issue 51): against a real engine on a VL fixture, in headless Chromium
(tests/browser.py), through the real server on a free port. Skips, with the reason, where Chromium,
selenium or mlx-vlm is not installed."""

from __future__ import annotations

import pytest

from edge0.server.config import ServerConfig
from tests import test_server_ui as page
from tests.fake_server import running_server
from tests.test_server_ui import js, open_page, replies, reply_done, send, wait

browser = page.browser  # the page tests' headless Chromium fixture


def test_an_attached_image_is_shown_and_sent_to_a_vl_model(browser, tmp_path):
    """Against a real engine on the VL fixture: an image picked with the file button shows as a
    thumbnail, goes with the message as an image_url part, shows in the conversation and the reply
    is the engine's own for that image and text; a second message keeps the image in the history."""
    pytest.importorskip("mlx_vlm")
    import edge0
    from tests.fixtures.vision import random_image
    from tests.test_vision import vl_store

    engine = edge0.load(vl_store())
    picture = random_image(21)
    (tmp_path / "shot.png").write_bytes(picture)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}]
    want = engine.generate(engine.chat_prompt(messages), 6, images=[picture]).text
    with running_server(engine, ServerConfig()) as base:
        assert not open_page(browser, base)
        browser.find_element("id", "new-chat").click()
        browser.find_element("css selector", "#settings summary").click()
        for name, value in {"max_tokens": "6", "temperature": "0"}.items():
            box = browser.find_element("id", name)
            box.clear()
            box.send_keys(value)
        browser.find_element("id", "attach").send_keys(str(tmp_path / "shot.png"))
        wait(browser, lambda d: js(d, "return document.querySelectorAll('#attachments img').length") == 1, what="thumb")
        send(browser, "what is this?")
        wait(browser, reply_done, what="the reply")
        assert js(browser, "return document.querySelectorAll('#attachments img').length") == 0
        shown = js(
            browser,
            "const i = document.querySelector('.msg.user img.attached');"
            "return i && [i.src.slice(0, 22), i.complete && i.naturalWidth]",
        )
        assert shown == ["data:image/png;base64,", 64]
        meta = js(browser, "return [...document.querySelectorAll('.msg.assistant .meta')].pop().textContent")
        assert "error" not in meta
        assert replies(browser)[-1].strip() == want.strip()
        send(browser, "and now?")  # the history carries the image again: the server takes it
        wait(browser, reply_done, what="the second reply")
        meta = js(browser, "return [...document.querySelectorAll('.msg.assistant .meta')].pop().textContent")
        assert "error" not in meta
    engine.close()
