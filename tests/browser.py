"""Headless Chromium for the chat-page tests and scripts: Debian's `chromium` and `chromium-driver`
driven with selenium (`.ci/run` installs them). `start()` raises BrowserMissing when either is
absent, so the tests can skip with the reason.

The flags keep Chromium from calling home (component updates, sync, field trials): a test that
checks every request stays on 127.0.0.1 must see only the page's own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-features=Translate,OptimizationHints,MediaRouter",
    "--disable-dev-shm-usage",
]


class BrowserMissing(RuntimeError):
    pass


def paths() -> tuple[str, str]:
    """(chromium, chromedriver); raises BrowserMissing naming what to install."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        raise BrowserMissing("selenium is not installed (pip install selenium)") from None
    if not browser or not driver:
        raise BrowserMissing("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    return browser, driver


def start(profile: Path, width: int = 1400, height: int = 900):
    """A headless Chromium with a fresh profile in `profile`, logging network events and console."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = paths()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in FLAGS + [f"--user-data-dir={profile}", f"--window-size={width},{height}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def requested_urls(driver) -> list[str]:
    """URLs of every request the browser sent since the last call (Chrome's DevTools network log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls
