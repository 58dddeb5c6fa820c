"""Helpers shared by the tests (tiny models, a real server process, greedy references, kernel and schema
cases), imported as `tests.support.<module>`."""
