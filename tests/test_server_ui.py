"""The chat page: its files and headers, then the page itself in headless Chromium (tests/browser.py)
against the real server on a free port: the fake engine for chat, stop, history and markup, the
real engine on a fixture store for the statistics panel. One browser session serves every test;
they skip, with the reason, where Chromium or selenium is not installed."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from edge0.server.config import ServerConfig
from edge0.server.ui import CSP, assets
from tests import browser as chromium
from tests.fake_engine import FakeEngine
from tests.fake_server import running_server

KEY = "sk-page"
PAGE_LIMIT = 150_000  # bytes, all files of the page together (issue 27)
XSS = '<script>window.pwned=1</script><img src="/x-pwned" onerror="window.pwned=2">'


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(delay=0.01)
    with running_server(engine, ServerConfig(api_key=KEY)) as base:
        yield engine, base


SEEN: list[str] = []  # every URL the browser requested during these tests

# One worker runs this whole module (pyproject's --dist loadgroup): its tests share one browser, and
# the last one checks every URL the others made it request.
pytestmark = pytest.mark.xdist_group("browser")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    try:
        driver = chromium.start(tmp_path_factory.mktemp("chromium"))
    except chromium.BrowserMissing as e:
        pytest.skip(f"no browser for the page tests: {e}")
    driver.set_script_timeout(20)
    driver.get("about:blank")
    chromium.requested_urls(driver)  # the browser's own start-up pages, before the tests
    yield driver
    driver.quit()


def wait(driver, predicate, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate(driver)
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def js(driver, script, *args):
    return driver.execute_script(script, *args)


def send(driver, text):
    """Type `text` into the message box and press Enter."""
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", "prompt")
    box.click()
    for i, line in enumerate(text.split("\n")):
        if i:
            box.send_keys(Keys.SHIFT, Keys.ENTER)
        box.send_keys(line)
    box.send_keys(Keys.ENTER)


def replies(driver) -> list[str]:
    return js(driver, "return [...document.querySelectorAll('.msg.assistant .body')].map(n => n.textContent)")


def reply_done(driver) -> bool:
    return js(
        driver,
        "const m = [...document.querySelectorAll('.msg.assistant .meta')].pop();"
        "return !!m && !m.textContent.includes('writing') && document.querySelector('#stop').disabled",
    )


def open_page(driver, base, key=KEY) -> bool:
    """Load the page and wait until it is connected; True when it asked for the key (and got `key`)."""
    SEEN.extend(chromium.requested_urls(driver))
    driver.get(base + "/")
    state = wait(driver, lambda d: js(d, "return document.body.dataset.state"), what="the page to connect")
    if state == "key":
        assert js(driver, "return document.querySelector('#key-dialog').open")
        driver.find_element("id", "key-input").send_keys(key)
        driver.find_element("id", "key-save").click()
        wait(driver, lambda d: js(d, "return document.body.dataset.state") == "ready", what="the key to be taken")
        assert not js(driver, "return document.querySelector('#key-dialog').open")
    return state == "key"


def stats(base, key=None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(base + "/v1/stats", headers=headers, timeout=10).json()


# -- the files -------------------------------------------------------------------------------


def test_page_files_headers_and_size():
    files = assets()
    assert {"index.html", "app.js", "app.css", "markdown.js", "stats.js", "api.js", "store.js"} <= set(files)
    total = sum(map(len, files.values()))
    assert total < PAGE_LIMIT, f"the page is {total} bytes"
    with running_server(FakeEngine(), ServerConfig(api_key=KEY)) as base:
        for path in ["/", "/ui"]:
            r = httpx.get(base + path, timeout=10)  # the page itself needs no key
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert r.headers["content-security-policy"] == CSP and r.content == files["index.html"]
        html = files["index.html"].decode()
        referenced = set(re.findall(r'(?:src|href)="(/ui/[^"]+)"', html))
        for name in files:
            if name.endswith(".js"):
                referenced |= {"/ui/" + m for m in re.findall(r'from "\./([\w.]+)"', files[name].decode())}
        assert referenced == {"/ui/" + n for n in files if n != "index.html"}  # every file used, none missing
        for path in referenced:
            r = httpx.get(base + path, timeout=10)
            assert r.status_code == 200 and r.headers["content-security-policy"] == CSP
            assert r.headers["x-content-type-options"] == "nosniff"
        for path in ["/ui/nope.js", "/ui/..%2Fapp.py", "/ui/__init__.py"]:
            r = httpx.get(base + path, timeout=10)
            assert r.status_code == 404 and "error" in r.json()
    for name, body in files.items():  # nothing names another host (an SVG's namespace is no request)
        text = body.decode().replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert not re.search(r"(?:https?:)?//[\w-]+(?:\.[\w-]+)+", text), name
        assert "innerHTML" not in text and "outerHTML" not in text and "insertAdjacentHTML" not in text, name
    for directive in ["default-src 'none'", "script-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"]:
        assert directive in CSP


# -- in the browser ------------------------------------------------------------------------


@pytest.mark.slow  # in the default suite's time budget: the other browser tests stay
def test_key_asked_once_then_replies_stream_and_history_survives_a_reload(browser, fake):
    engine, base = fake
    browser.get(base + "/ui/icon.svg")
    js(browser, "localStorage.clear()")  # a first visit
    assert open_page(browser, base)
    # Record every state of the reply's text as it changes (a streamed reply grows in steps).
    js(
        browser,
        "window.seen = []; new MutationObserver(() => { const b = [...document.querySelectorAll("
        "'.msg.assistant .body')].pop(); if (b) window.seen.push(b.textContent); })"
        ".observe(document.querySelector('#messages'), {subtree: true, childList: true, characterData: true})",
    )
    send(browser, "count 40")
    wait(browser, reply_done, what="the reply")
    final = " ".join(str(i) for i in range(40))
    assert replies(browser) == [final]
    seen = js(browser, "return window.seen")
    partial = [s for s in seen if s and s != final]
    assert len(partial) >= 3 and all(final.startswith(s) for s in partial), seen[:5]

    send(browser, "and more")
    wait(browser, lambda d: len(replies(d)) == 2 and reply_done(d), what="the second reply")
    assert replies(browser)[1] == "Echo: and more"
    prompt = engine.tokenizer.decode(engine.calls[-1].prompt)
    assert "count 40" in prompt and final in prompt and "and more" in prompt  # the whole conversation went

    assert not open_page(browser, base)  # reloaded: the key was kept
    titles = js(browser, "return [...document.querySelectorAll('#chat-list .open')].map(b => b.textContent)")
    assert titles == ["count 40"]
    assert replies(browser) == [final, "Echo: and more"]
    users = js(browser, "return [...document.querySelectorAll('.msg.user .body')].map(n => n.textContent)")
    assert users == ["count 40", "and more"]


def test_stop_cancels_the_generation_on_the_server(browser, fake):
    from selenium.webdriver.common.keys import Keys

    engine, base = fake
    open_page(browser, base)
    browser.find_element("id", "new-chat").click()
    before = stats(base, KEY)["server"]
    engine.delay = 0.03
    try:
        send(browser, "count 3000")
        wait(browser, lambda d: len((replies(d) or [""])[-1]) > 20, what="some text")
        browser.find_element("id", "stop").click()
        wait(browser, reply_done, what="the page to stop")
    finally:
        engine.delay = 0.01
    after = wait(
        browser,
        lambda d: (s := stats(base, KEY)["server"])["cancelled"] == before["cancelled"] + 1 and s,
        what="the server to count the cancel",
    )
    assert after["requests_in_flight"] == 0 and after["completed"] == before["completed"]
    call = engine.calls[-1]
    assert call.closed_early and call.finish_reason is None and 0 < call.steps < 3000
    meta = js(browser, "return [...document.querySelectorAll('.msg.assistant .meta')].pop().textContent")
    assert "stopped" in meta
    shown = replies(browser)[-1]
    assert " ".join(str(i) for i in range(3000)).startswith(shown) and len(shown) > 20

    # Escape stops too, and the freed engine answers the next message.
    send(browser, "count 3000")
    wait(browser, lambda d: len(replies(d)[-1]) > 20 and not reply_done(d), what="the next reply")
    browser.find_element("id", "prompt").send_keys(Keys.ESCAPE)
    wait(browser, lambda d: stats(base, KEY)["server"]["cancelled"] == before["cancelled"] + 2, what="Escape")
    send(browser, "still there?")
    wait(browser, lambda d: replies(d)[-1] == "Echo: still there?" and reply_done(d), what="an answer")
    # The stopped replies stay in the history, and the next request carried them.
    assert "count 3000" in engine.tokenizer.decode(engine.calls[-1].prompt)


def test_model_markup_is_shown_as_text_and_markdown_renders(browser, fake):
    engine, base = fake
    open_page(browser, base)
    browser.find_element("id", "new-chat").click()
    send(browser, f'{XSS} **bold** and `x<y>`\n```html\n<b onclick="alert(1)">hi</b>\n```')
    wait(browser, reply_done, what="the reply")
    body = browser.find_elements("css selector", ".msg.assistant .body")[-1]
    assert js(browser, "return window.pwned") is None
    assert js(browser, "return document.querySelectorAll('#messages script, #messages img, #messages b').length") == 0
    text = body.get_attribute("textContent")
    assert XSS in text  # the characters, as the model wrote them
    assert body.find_element("css selector", "strong").text == "bold"
    assert [c.text for c in body.find_elements("css selector", "p code")] == ["x<y>"]
    assert body.find_element("css selector", "pre code").get_attribute("textContent") == '<b onclick="alert(1)">hi</b>'
    SEEN.extend(chromium.requested_urls(browser))
    assert not [u for u in SEEN if "x-pwned" in u]

    # The renderer alone: which markup becomes which element, and links only for http(s) and mailto.
    cases = {
        "# Title\n\n- a\n- *b*\n\n3. c\n4. d": "<h3>Title</h3><ul><li>a</li><li><em>b</em></li></ul>"
        '<ol start="3"><li>c</li><li>d</li></ol>',
        "> quoted ~~no~~\n\n---": "<blockquote><p>quoted <del>no</del></p></blockquote><hr>",
        "[site](https://example.org/a) [bad](javascript:alert(1)) ![pic](http://x.example/p.png)": (
            '<p><a href="https://example.org/a" rel="noopener noreferrer" target="_blank">site</a> '
            '[bad](javascript:alert(1)) <a href="http://x.example/p.png" rel="noopener noreferrer" '
            'target="_blank">pic</a></p>'
        ),
        "```\nstill streaming <i>": (
            '<div class="code"><div class="code-bar"><span>code</span><button class="copy" type="button" '
            'aria-label="Copy code block">Copy</button></div><pre><code>still streaming &lt;i&gt;</code></pre></div>'
        ),
        "a\nb **c `d`**": "<p>a<br>b <strong>c <code>d</code></strong></p>",
    }
    out = browser.execute_async_script(
        """const [cases, done] = [arguments[0], arguments[arguments.length - 1]];
        import('/ui/markdown.js').then(({renderMarkdown}) => done(Object.keys(cases).map(text => {
          const box = document.createElement('div'); box.append(renderMarkdown(text)); return box.innerHTML;
        })), e => done(String(e)));""",
        cases,
    )
    assert out == list(cases.values())


def test_markdown_is_linear_and_incremental_while_streaming(browser, fake, capsys):
    """64 KB of bracket-heavy text took 3.8 s per render, and the page rendered the whole reply on
    every animation frame; 8,000 nested quotes overflowed the stack."""
    _, base = fake
    open_page(browser, base)
    out = browser.execute_async_script(
        """const done = arguments[arguments.length - 1];
        import('/ui/markdown.js').then(({renderMarkdown, MarkdownView}) => {
          const times = {};
          for (const [name, unit] of [['links', '[a]('], ['code', '`a'], ['bold', '**a'], ['quotes', '> ']]) {
            const text = unit.repeat(64000 / unit.length);
            const started = performance.now();
            const box = document.createElement('div');
            box.append(renderMarkdown(text));
            times[name] = performance.now() - started;
          }
          // streaming: the finished blocks are kept (the same nodes), only the last one is rendered again
          const box = document.createElement('div');
          const view = new MarkdownView(box);
          let text = '';
          const started = performance.now();
          for (let i = 0; i < 2000; i++) {
            text += `Line ${i} with [a link](https://example.org/${i}) and **bold**.\n\n`;
            view.update(text);
          }
          const first = box.firstChild;
          view.update(text + 'more');
          const whole = document.createElement('div');
          whole.append(renderMarkdown(text + 'more'));
          done({times, stream: performance.now() - started, kept: box.firstChild === first,
                same: box.innerHTML === whole.innerHTML, blocks: box.childElementCount});
        }, e => done(String(e)));""",
    )
    with capsys.disabled():
        ms = ", ".join(f"{k} {v:.0f} ms" for k, v in out["times"].items())
        print(f"\nmarkdown, 64 KB: {ms}; 2,000 streamed updates: {out['stream']:.0f} ms")
    assert out["kept"] and out["same"] and out["blocks"] == 2001, out
    assert max(out["times"].values()) < 1000, out  # ms for 64 KB (the quadratic renderer: 3,800 for links)
    assert out["stream"] < 5000, out  # 2,000 updates of a 140 KB reply (whole renders: minutes)


def test_keyboard_labels_and_phone_width(browser, fake):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    engine, base = fake
    try:
        browser.set_window_size(390, 844)
        open_page(browser, base)
        unlabeled = js(
            browser,
            "return [...document.querySelectorAll('input, textarea, button, canvas, [role=img]')].filter(e => "
            "!(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.textContent.trim()).map(e => e.id)",
        )
        assert unlabeled == []
        # The first Tab reaches the skip link, which leads to the message box. Focus starts at the top of
        # the page whatever had it before (the message box, or the key dialog's field): a helper that is
        # focusable only by script, first in the page, holds it for that Tab.
        js(
            browser,
            "const start = document.createElement('span'); start.id = 'tab-start'; start.tabIndex = -1;"
            "document.body.prepend(start); start.focus();",
        )
        ActionChains(browser).send_keys(Keys.TAB).perform()
        js(browser, "document.getElementById('tab-start').remove()")
        assert js(browser, "return document.activeElement.className") == "skip"
        ActionChains(browser).send_keys(Keys.ENTER).perform()
        assert js(browser, "return document.activeElement.id") == "prompt"
        assert js(browser, "return document.documentElement.scrollWidth <= window.innerWidth")
        assert not browser.find_element("id", "stats").is_displayed()
        toggle = browser.find_element("id", "toggle-stats")
        toggle.click()
        assert browser.find_element("id", "stats").is_displayed() and toggle.get_attribute("aria-expanded") == "true"
        toggle.click()
        assert not browser.find_element("id", "stats").is_displayed()
        browser.find_element("id", "toggle-chats").click()  # the conversations open from the header
        browser.find_element("id", "new-chat").click()
        assert not browser.find_element("id", "chats").is_displayed()
        send(browser, "typed on a phone")
        wait(browser, lambda d: replies(d) == ["Echo: typed on a phone"] and reply_done(d), what="the reply")
        assert js(browser, "return document.documentElement.scrollWidth <= window.innerWidth")
    finally:
        browser.set_window_size(1400, 900)


def test_the_verdict_names_the_bottleneck(browser, fake):
    engine, base = fake
    open_page(browser, base)
    out = browser.execute_async_script(
        """const done = arguments[arguments.length - 1];
        import('/ui/stats.js').then(({verdict}) => done([
          verdict(null),
          verdict({tps: 20, stallPerStep: 1, hitRate: 0.5, bytesPerToken: 1e6, cacheBytes: 1e9, availableBytes: 8e9}),
          verdict({tps: 5, stallPerStep: 150, hitRate: 0.4, bytesPerToken: 8e7, cacheBytes: 1e9, availableBytes: 8e9}),
          verdict({tps: 5, stallPerStep: 150, hitRate: 0.95, bytesPerToken: 8e6, cacheBytes: 1e9, availableBytes: 8e9}),
          verdict({tps: 5, stallPerStep: 150, hitRate: 0.4, bytesPerToken: 8e7, cacheBytes: 4e9, availableBytes: 5e8}),
        ]), e => done(String(e)));"""
    )
    kinds = [v["kind"] for v in out]
    assert kinds == ["idle", "compute", "cache", "disk", "disk"]
    assert "2.0%" in out[1]["text"] and "50.0 ms step" in out[1]["text"]  # 1 ms of a 50 ms step
    assert "40.0%" in out[2]["text"] and "--expert-cache" in out[2]["text"] and "80.0 MB per token" in out[2]["text"]
    assert "75.0%" in out[3]["text"] and "95.0%" in out[3]["text"]  # 150 ms of a 200 ms step
    assert "no memory for a larger cache" in out[4]["text"]

    # The live numbers leave out polls in which nothing was decoded.
    out = browser.execute_async_script(
        """const done = arguments[arguments.length - 1];
        const c = (t, steps, bytes, hits, misses, stall) => ({t, steps, bytes, hits, misses, stall});
        const samples = [c(0, 0, 0, 0, 0, 0), c(1000, 10, 1000, 6, 4, 5), c(2000, 10, 1000, 6, 4, 5),
                         c(3000, 30, 3000, 16, 4, 25)];
        import('/ui/stats.js').then(({activeRates, rates}) => done([
          activeRates(samples, -1), activeRates(samples, 1500), rates(samples[0], samples[3]),
          rates(samples[1], samples[2]), activeRates(samples.slice(0, 1), -1)]), e => done(String(e)));"""
    )
    assert out[0] == {
        "steps": 30,
        "seconds": 2,
        "tps": 15,
        "hitRate": 0.8,
        "bytesPerToken": 100,
        "stallPerStep": 25 / 30,
    }
    assert out[1]["tps"] == 20 and out[1]["hitRate"] == 1 and out[1]["steps"] == 20
    assert out[2]["tps"] == 10 and out[3] is None and out[4] is None


def test_stats_panel_shows_what_v1_stats_says(browser, store_for):
    """Against the real engine: the panel's numbers are /v1/stats's, and a reply's are the
    difference of the counters before and after it."""
    import edge0

    engine = edge0.load(store_for("qwen3_moe"))
    with running_server(engine, ServerConfig()) as base:
        assert not open_page(browser, base)  # no key needed
        browser.find_element("css selector", "#settings summary").click()
        for name, value in {"max_tokens": "12", "temperature": "0"}.items():
            box = browser.find_element("id", name)
            box.clear()
            box.send_keys(value)
        before = stats(base)["engine"]
        send(browser, "hello there")
        wait(browser, reply_done, what="the reply")
        deadline = time.monotonic() + 10  # the scheduler counts the request done just after its last token
        while (now := stats(base))["server"]["requests_in_flight"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        e = now["engine"]
        assert e["decode_steps"] > before["decode_steps"]

        def shown(d):
            values = js(
                d,
                "return Object.fromEntries([...document.querySelectorAll('[data-metric]')]"
                ".filter(n => n.dataset.value !== undefined).map(n => [n.dataset.metric, n.dataset.value]))",
            )
            # a poll between the last decode step and the scheduler's counters shows the request in flight
            ok = values.get("decode_steps") == str(e["decode_steps"]) and "reply_tps" in values
            ok = ok and values.get("completed") == str(now["server"]["completed"])
            return values if ok and values.get("requests_in_flight") == "0" else None

        values = wait(browser, shown, what="the panel to catch up")
        totals, io = e["totals"], e["io"]
        exact = {
            "decode_steps": e["decode_steps"],
            "reads": io["reads"],
            "reader": io["reader"],
            "queue_depth": io["queue_depth"],
            "max_queue_depth": io["max_queue_depth"],
            "resident_bytes": e["resident_bytes"],
            "expert_cache_bytes": e["expert_cache_bytes"],
            "completed": now["server"]["completed"],
            "requests_in_flight": 0,
            "pc_memory": e["prompt_cache"]["memory"]["entries"],
            "pc_hits": e["prompt_cache"]["memory"]["hits"],
            "pc_evicted": e["prompt_cache"]["memory"]["evicted"],
        }
        for name, value in exact.items():
            assert values[name] == str(value), name
        close = {
            "hit_rate": totals["hit_rate"],
            "bytes_per_token": totals["bytes_read"] / e["decode_steps"],
            "stall_ms_per_step": e["stall_ms_per_step"],
            "reply_hit_rate": (totals["hits"] - before["totals"]["hits"])
            / (totals["hits"] + totals["misses"] - before["totals"]["hits"] - before["totals"]["misses"]),
            "reply_bytes_per_token": (totals["bytes_read"] - before["totals"]["bytes_read"])
            / (e["decode_steps"] - before["decode_steps"]),
            "reply_stall": (totals["stall_ms"] - before["totals"]["stall_ms"])
            / (e["decode_steps"] - before["decode_steps"]),
        }
        for name, value in close.items():
            assert float(values[name]) == pytest.approx(value, rel=1e-9), name
        available = now["machine"]["memory_available_bytes"]
        assert float(values["memory_available_bytes"]) == pytest.approx(available, rel=0.2)
        assert int(values["reply_tokens"]) == engine.stats()["decode_steps"] - before["decode_steps"]
        texts = js(
            browser,
            "return Object.fromEntries([...document.querySelectorAll('[data-metric]')]"
            ".map(n => [n.dataset.metric, n.textContent]))",
        )
        # shown to one decimal (JavaScript rounds halves up, Python's format to even: compare the value)
        shown = texts["hit_rate"]
        assert shown.endswith("%") and abs(float(shown[:-1]) - 100 * totals["hit_rate"]) <= 0.05 + 1e-9
        assert texts["reader"] == io["reader"]
        verdict = browser.find_element("id", "verdict")
        assert verdict.get_attribute("data-kind") in ("compute", "cache", "disk") and verdict.text
        labels = js(
            browser, "return [...document.querySelectorAll('#stats canvas')].map(c => c.getAttribute('aria-label'))"
        )
        assert len(labels) == 4 and all("latest" in label for label in labels)


def test_no_request_left_127_0_0_1(browser):
    """Every request the browser sent during these tests went to the servers on 127.0.0.1, and the
    Content-Security-Policy refused nothing (nothing tried to load from elsewhere)."""
    SEEN.extend(chromium.requested_urls(browser))
    pages = [u for u in SEEN if not u.startswith("data:")]
    assert len(pages) > 20
    assert [u for u in pages if not re.match(r"http://127\.0\.0\.1:\d+/", u)] == []
    console = browser.get_log("browser")
    assert not [m for m in console if "Content Security Policy" in m["message"]], console
    resources = js(browser, "return performance.getEntries().map(e => e.name).filter(n => n.includes('://'))")
    assert resources and all(re.match(r"http://127\.0\.0\.1:\d+/", n) for n in resources), resources
