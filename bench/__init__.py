"""Benchmarks, run as scripts (`python bench/<name>.py`). A package so that tests import the modules they share
(`bench.soak`, `bench.synthetic_model`)."""
