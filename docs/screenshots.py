"""The chat page's screenshots in docs/ (desktop 1280x800 and phone 390x844, light theme, a short real conversation
with smollm2-135m under the `precise` preset), taken with the system's Chromium. Run by hand from the repository
root after changing the page:

    PYTHONPATH=. .venv/bin/python docs/screenshots.py
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from tests.support.chat_page import launch, open_page, send, wait_answered
from tests.support.server_process import start_server, stop_server

DOCS = Path(__file__).resolve().parent
QUESTIONS = ("Explain in two sentences what a CPU does.", "Give me a Python function that reverses a string.")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), "--model", "smollm2-135m")
        try:
            with sync_playwright() as playwright:
                browser = launch(playwright)
                context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light",
                                              device_scale_factor=1)
                page = context.new_page()
                open_page(page, server.base_url)
                page.select_option("#preset", "precise")
                page.fill("#max-tokens", "160")
                for question in QUESTIONS:
                    send(page, question)
                    wait_answered(page)
                page.locator("#prompt").blur()
                page.screenshot(path=str(DOCS / "chat-page-desktop.png"))
                phone = context.new_page()  # the same browser storage: the same conversation
                phone.set_viewport_size({"width": 390, "height": 844})
                open_page(phone, server.base_url)
                phone.locator("#prompt").blur()
                phone.screenshot(path=str(DOCS / "chat-page-phone.png"))
                browser.close()
        finally:
            stop_server(server)
    print(f"wrote {DOCS / 'chat-page-desktop.png'} and {DOCS / 'chat-page-phone.png'}")


if __name__ == "__main__":
    main()
