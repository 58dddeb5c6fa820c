"""The soak (bench/soak.py) in short: 80 mixed requests at concurrency 32 against a real server, a fifth of the
clients leaving at random moments; then no 5xx, every KV block outside the prefix cache free, nothing running, and
RSS flat from the first mark to the end. The long run's figures are in bench/RESULTS.md#issue-12-soak."""
from __future__ import annotations

import asyncio

from bench import soak
from tests.support.server_process import start_server, stop_server


def test_a_short_soak_leaves_nothing_behind(tmp_path) -> None:
    srv = start_server(tmp_path, "--model", soak.MODEL)
    try:
        result = asyncio.run(soak.soak(srv.base_url, srv.process.pid, requests=80, concurrency=32,
                                       leave_fraction=0.2, max_tokens=16, mark=30, seed=1))
    finally:
        stop_server(srv)
    verdict = soak.checks(result, rss_tolerance=0.05)
    assert verdict == {"no_5xx": True, "kv_blocks_free": True, "nothing_running": True, "rss_flat": True}, \
        (verdict, result.failures, result.rss_mib, result.__dict__["health"])
    # the run exercised what it is meant to
    assert result.outcomes["ok"] > 40 and result.outcomes["left"] > 8 and result.outcomes["4xx"] >= 1, \
        result.outcomes
    assert " ERROR " not in srv.log() and "Traceback" not in srv.log(), srv.log()[-3000:]
