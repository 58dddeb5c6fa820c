"""prompt_work: a small request's prompt work runs on the event loop, a big or unsized one in the thread pool."""
from __future__ import annotations

import asyncio
import threading

import pytest

from server.logs import RequestRecord, set_current_request
from server.api.openai.serving import INLINE_PROMPT_BYTES, prompt_work


@pytest.mark.parametrize(("body_bytes", "inline"), [(200, True), (INLINE_PROMPT_BYTES, True),
                                                    (INLINE_PROMPT_BYTES + 1, False), (None, False)])
def test_prompt_work_runs_inline_only_for_a_small_body(body_bytes: int | None, inline: bool) -> None:
    async def main() -> bool:
        set_current_request(RequestRecord("id", "POST", "/v1/completions", body_bytes=body_bytes))
        loop_thread = threading.get_ident()
        ran_on = await prompt_work(threading.get_ident)
        return ran_on == loop_thread

    assert asyncio.run(main()) is inline


def test_prompt_work_outside_a_request_goes_to_the_thread_pool() -> None:
    async def main() -> bool:
        return await prompt_work(threading.get_ident) == threading.get_ident()

    assert asyncio.run(main()) is False


def test_prompt_work_raises_the_work_s_error_either_way() -> None:
    def bad() -> None:
        raise ValueError("bad prompt")

    async def main(size: int) -> None:
        set_current_request(RequestRecord("id", "POST", "/v1/completions", body_bytes=size))
        await prompt_work(bad)

    for size in (10, INLINE_PROMPT_BYTES * 2):
        with pytest.raises(ValueError, match="bad prompt"):
            asyncio.run(main(size))
