"""Driving the chat page (server/api/chat_page) in the system's Chromium with Playwright: for the e2e tests and
docs/screenshots.py."""
from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Browser, Page, Playwright

CHROMIUM = Path("/usr/bin/chromium")
ANSWER_TIMEOUT_MS = 120_000
# The page is idle: no answer streaming (aria-busy), Send back in place of Stop.
_ANSWERED = "() => !document.querySelector('[aria-busy=true]') && !document.getElementById('send').hidden"


def launch(playwright: Playwright) -> Browser:
    """Headless Chromium, the system's (Playwright downloads no browser here)."""
    if not CHROMIUM.exists():
        raise RuntimeError(f"the chat page's browser tests need Chromium at {CHROMIUM}: apt-get install chromium")
    return playwright.chromium.launch(executable_path=str(CHROMIUM))


def open_page(page: Page, base_url: str) -> None:
    """Load the page and wait until its model and preset lists are in."""
    page.goto(base_url + "/")
    page.wait_for_selector("body.ready")


def send(page: Page, text: str) -> None:
    """Type `text` in the message box and press Enter."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_answered(page: Page) -> None:
    page.wait_for_function(_ANSWERED, timeout=ANSWER_TIMEOUT_MS)
