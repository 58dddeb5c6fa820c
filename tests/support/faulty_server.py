"""`python tests/support/faulty_server.py serve ...`: the real server process with faults planted in its runner, for
the fault-isolation tests (tests/e2e/test_faults.py). A sequence whose text holds a marker makes the runner fail:

- FAULT_ROW: the runner refuses the row (`row_error`), as it refuses a sequence past its context;
- FAULT_CRASH: the forward pass raises (a crashed step), once the sequence has generated 3 tokens;
- FAULT_FATAL: the forward pass raises an exception no handler is meant to catch, killing the worker thread.
"""
from __future__ import annotations

import sys

from engine.errors import RowRefusal
from engine.runtime.runner import Runner
from server.launch.cli import main

CRASH_AFTER_TOKENS = 3


class PlantedFatalFault(BaseException):
    """Escapes `except Exception`, as a fault of the interpreter or the device would."""


def _text(runner: Runner, tokens: list[int]) -> str:
    return runner.tokenizer.decode(tokens[:96])


_real_step, _real_row_error = Runner.step, Runner.row_error
_decoded: dict[int, int] = {}  # id of a marked sequence -> its decode rows so far


def _step(self: Runner, rows):
    for row in rows:
        text = _text(self, row.seq.tokens)
        if "FAULT_FATAL" in text:
            raise PlantedFatalFault("planted fatal fault")
        if "FAULT_CRASH" in text and row.end - row.start == 1:
            _decoded[id(row.seq)] = count = _decoded.get(id(row.seq), 0) + 1
            if count > CRASH_AFTER_TOKENS:
                raise RuntimeError("planted crash in the forward pass")
    return _real_step(self, rows)


def _row_error(self: Runner, seq, start: int, end: int):
    if "FAULT_ROW" in _text(self, seq.tokens):
        return RowRefusal("planted: the runner refuses this row")
    return _real_row_error(self, seq, start, end)


Runner.step, Runner.row_error = _step, _row_error

if __name__ == "__main__":
    sys.exit(main())
