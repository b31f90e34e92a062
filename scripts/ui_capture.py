"""Screenshots of the chat page and its load time, from a real server on this machine.

Serves a model (default: the bundled demo model) on a free port of 127.0.0.1, opens the page in
headless Chromium (tests/browser.py), chats, and saves:
  OUT/ui-chat.png   the whole page after two replies (chat and statistics panel)
  OUT/ui-stats.png  the statistics panel alone (in a taller window)
  OUT/ui-phone.png  the page at phone width (390x844)
then loads the page --loads times in a fresh tab and prints the load times (Navigation Timing:
DOMContentLoaded, load, and "connected": the page has asked the server who it is and may start).

    PYTHONPATH=$PWD python scripts/ui_capture.py [--model DIR] [--out docs/images] [--loads 20]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import uvicorn

import edge0
from edge0.server.app import create_app
from edge0.server.config import ServerConfig
from edge0.server.ui import assets
from tests import browser as chromium

PROMPTS = ["What does the Python tutorial cover?", "How do I read a file line by line?"]


def serve(engine):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerConfig()), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def wait(driver, script, timeout=120):
    deadline = time.monotonic() + timeout
    while not driver.execute_script(script):
        if time.monotonic() > deadline:
            raise TimeoutError(script)
        time.sleep(0.1)


def chat(driver, text):
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", "prompt")
    box.send_keys(text, Keys.ENTER)
    time.sleep(0.3)
    wait(driver, "return document.querySelector('#stop').disabled")
    time.sleep(1.5)  # the panel's next poll


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="store directory (default: the bundled demo model)")
    p.add_argument("--out", type=Path, default=Path("docs/images"))
    p.add_argument("--loads", type=int, default=20)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine = edge0.load(args.model)
    server, base = serve(engine)
    driver = chromium.start(Path(tempfile.mkdtemp(prefix="edge0-ui-")), 1400, 900)
    try:
        driver.get(base + "/")
        wait(driver, "return document.body.dataset.state === 'ready'")
        driver.find_element("css selector", "#settings summary").click()
        max_tokens = driver.find_element("id", "max_tokens")
        max_tokens.clear()
        max_tokens.send_keys("120")
        driver.find_element("css selector", "#settings summary").click()
        for text in PROMPTS:
            chat(driver, text)
        driver.save_screenshot(str(args.out / "ui-chat.png"))
        driver.set_window_size(1400, 1200)  # tall enough for the whole panel
        time.sleep(1.5)
        driver.find_element("id", "stats").screenshot(str(args.out / "ui-stats.png"))
        driver.set_window_size(390, 844)
        time.sleep(0.5)
        driver.save_screenshot(str(args.out / "ui-phone.png"))
        driver.set_window_size(1400, 900)

        times = {"DOMContentLoaded": [], "load": [], "connected": []}
        transferred = []
        for _ in range(args.loads):
            driver.get("about:blank")
            driver.get(base + "/")
            wait(driver, "return performance.getEntriesByName('edge0-ready').length > 0")
            nav, ready = driver.execute_script(
                "const n = performance.getEntriesByType('navigation')[0];"
                "return [n.toJSON(), performance.getEntriesByName('edge0-ready')[0].startTime]"
            )
            times["DOMContentLoaded"].append(nav["domContentLoadedEventEnd"])
            times["load"].append(nav["loadEventEnd"])
            times["connected"].append(ready)
            transferred.append(
                driver.execute_script(
                    "return performance.getEntriesByType('resource').concat(performance.getEntriesByType("
                    "'navigation')).filter(e => e.name.includes('/ui') || e.entryType === 'navigation')"
                    ".reduce((a, e) => a + e.encodedBodySize, 0)"
                )
            )
    finally:
        driver.quit()
        server.should_exit = True
    print(f"page files: {sum(map(len, assets().values()))} bytes; fetched per load: {transferred[-1]} bytes")
    print(f"{args.loads} loads from {base} (ms after navigation start): median / p90 / max")
    for name, values in times.items():
        values = sorted(values)
        p90 = values[int(0.9 * (len(values) - 1))]
        print(f"  {name}: {statistics.median(values):.1f} / {p90:.1f} / {values[-1]:.1f}")
    print(f"screenshots in {args.out}")


if __name__ == "__main__":
    main()
