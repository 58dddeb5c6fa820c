"""The settings object: environment variables, CLI flags over them, validation, the README's table, and the
start-up progress bar."""
from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.launch.cli import main, settings_arguments
from server.scheduling.progress import LoadProgress
from server.config.settings import RENAMED, Settings, env_name, flag_name, settings_table

README = Path(__file__).resolve().parents[3] / "README.md"


def test_environment_variables_fill_every_kind_of_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"EMBERSERVE_PORT": "9001", "EMBERSERVE_PREFIX_CACHING": "false", "EMBERSERVE_KV_CACHE_MEMORY": "1GiB",
           "EMBERSERVE_ALLOWED_ORIGINS": "https://a.example, https://b.example", "EMBERSERVE_API_KEY": "k-1",
           "EMBERSERVE_QUANT": "INT8", "EMBERSERVE_SHUTDOWN_GRACE": "2.5", "EMBERSERVE_LOG_FORMAT": "json"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    assert (s.port, s.prefix_caching, s.kv_cache_memory, s.quant, s.shutdown_grace, s.log_format) == \
        (9001, False, 2**30, "int8", 2.5, "json")
    assert s.allowed_origins == ["https://a.example", "https://b.example"]
    assert s.api_key is not None and s.api_key.get_secret_value() == "k-1"
    assert "k-1" not in repr(s) and "k-1" not in str(s.model_dump())


def test_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBERSERVE_PORT", "9001")
    monkeypatch.setenv("EMBERSERVE_MAX_NUM_SEQS", "4")
    s = Settings(port="9002")
    assert s.port == 9002 and s.max_num_seqs == 4


@pytest.mark.parametrize("name, value", [("EMBERSERVE_PORT", "eighty"), ("EMBERSERVE_WORKERS", "0"),
                                         ("EMBERSERVE_KV_CACHE_MEMORY", "lots"), ("EMBERSERVE_DTYPE", "int3"),
                                         ("EMBERSERVE_NOT_A_SETTING_AT_ALL", None)])
def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str | None) -> None:
    if value is None:  # unknown variables are ignored (the prefix is shared with nothing else), unknown fields not
        monkeypatch.setenv(name, "1")
        Settings()
        with pytest.raises(ValidationError):
            Settings(not_a_setting_at_all=1)
        return
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        Settings()


def test_tensor_parallelism_is_one_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBERSERVE_TENSOR_PARALLEL_SIZE", "2")
    assert Settings().tensor_parallel_size == 2
    with pytest.raises(ValidationError, match="tensor_parallel_size 2 and workers 2"):
        Settings(workers=2)
    with pytest.raises(ValidationError):
        Settings(tensor_parallel_size=0)


def test_the_cli_names_the_bad_setting_and_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EMBERSERVE_MAX_QUEUED", "-1")
    assert main(["serve"]) == 2
    assert "--max-queued / EMBERSERVE_MAX_QUEUED" in capsys.readouterr().err
    monkeypatch.delenv("EMBERSERVE_MAX_QUEUED")
    assert main(["serve", "--max-request-bytes", "1 gazillion"]) == 2
    assert "not a memory size" in capsys.readouterr().err


def test_every_setting_has_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in text and f"EMBERSERVE_{name.upper()}" in text


def test_the_readme_table_is_the_settings_table() -> None:
    assert settings_table() in README.read_text(), "regenerate with: python -c 'from server.config.settings import " \
                                                   "settings_table; print(settings_table())'"


def test_load_progress_draws_a_bar_on_a_terminal_and_logs_steps_otherwise(caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    bar = LoadProgress(out, interactive=True)
    for i in range(1, 11):
        bar("reading weights", i, 10)
    assert "[" + "#" * 30 + "] 100% 10/10" in out.getvalue() and out.getvalue().endswith("\n")
    quiet = LoadProgress(io.StringIO(), interactive=False)
    with caplog.at_level("INFO", logger="emberserve"):
        for i in range(1, 101):
            quiet("packing int4 weights", i, 100)
    assert [r.getMessage() for r in caplog.records] == [f"packing int4 weights: {p}% ({p}/100)"
                                                        for p in (1, 26, 51, 76, 100)]


def test_a_token_budget_below_the_batch_is_refused() -> None:
    with pytest.raises(ValidationError,
                       match=r"max_num_batched_tokens \(16\) must be at least max_num_seqs \(32\)"):
        Settings(max_num_batched_tokens=16)
    with pytest.raises(ValidationError,
                       match=r"max_num_batched_tokens \(512\) must be at least max_num_seqs \(600\)"):
        Settings(max_num_seqs=600)
    assert Settings(max_num_batched_tokens=16, max_num_seqs=16).max_num_seqs == 16
    assert Settings(device="cuda", max_num_seqs=600).max_num_seqs == 600  # the GPU's default budget holds 8192


def test_an_encoder_takes_whole_batches_unless_told_otherwise() -> None:
    from server.config.settings import device_default

    assert device_default(Settings(), "max_num_batched_tokens") == 512
    assert device_default(Settings(), "max_num_batched_tokens", encoder=True) == 8192
    assert device_default(Settings(max_num_batched_tokens=64), "max_num_batched_tokens", encoder=True) == 64
    assert device_default(Settings(), "max_num_seqs", encoder=True) == 32


def test_on_a_gpu_speculation_stops_past_the_rows_a_graph_step_verifies() -> None:
    """Past MAX_CHUNKS drafting sequences a GPU step runs eagerly (slower than no speculation): the default stops
    there on a GPU, never on CPU; a value given wins."""
    from engine.runtime.chunk_graphs import MAX_CHUNKS
    from server.config.settings import device_default

    name = "speculative_disable_by_batch_size"
    assert device_default(Settings(device="cuda"), name) == MAX_CHUNKS == 4
    assert device_default(Settings(), name) is None
    assert device_default(Settings(device="cuda", speculative_disable_by_batch_size=16), name) == 16


def test_pooling_takes_last_or_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBERSERVE_POOLING", "MEAN")
    assert Settings().pooling == "mean" and Settings(pooling="last").pooling == "last"
    with pytest.raises(ValidationError):
        Settings(pooling="max")


def test_speculation_settings_are_coherent() -> None:
    assert Settings().speculative_method is None
    assert Settings(speculative="NGRAM").speculative_method == "ngram"
    assert Settings(draft_model="self-int4").speculative_method == "draft"  # a draft model implies it
    assert Settings(draft_model="self-int4", speculative="draft").speculative_method == "draft"
    for bad in (dict(speculative="draft"), dict(speculative="ngram", draft_model="self-int4"),
                dict(ngram_min=3, ngram_max=2), dict(num_speculative_tokens=0)):
        with pytest.raises(ValidationError):
            Settings(**bad)


def test_a_missing_draft_model_stops_the_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--draft-model", "/no/such/draft.gguf"]) == 2
    assert "draft model not found" in capsys.readouterr().err


def test_malloc_arenas_are_capped_on_glibc() -> None:
    """The cap the serve command sets before its threads start (the soak's flat-RSS check relies on it)."""
    import platform

    from server.scheduling.threads import cap_malloc_arenas

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert cap_malloc_arenas() is True


def test_the_settings_module_loads_neither_torch_nor_the_runner() -> None:
    """`import server.config.settings` (the CLI's flags, `--help`, a settings check) stays light: the engine's public
    names load on first use."""
    code = "import sys, server.config.settings; print('torch' in sys.modules, 'engine.runtime.runner' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=README.parent)
    assert done.stdout.split() == ["False", "False"], done.stderr[-2000:]


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_the_old_names_of_renamed_settings_still_work(old: str, new: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_context, max_running and max_batched_tokens took vLLM's names; their keywords, EMBERSERVE_* variables and
    flags are aliases of the new ones, and the new name wins over the old one's variable."""
    assert getattr(Settings(**{old: 64}), new) == 64
    monkeypatch.setenv(env_name(old), "48")
    assert getattr(Settings(), new) == 48
    monkeypatch.setenv(env_name(new), "40")
    assert getattr(Settings(), new) == 40
    with pytest.raises(ValidationError, match=f"{old} is the old name of {new}"):
        Settings(**{old: 64, new: 64})
    parser = argparse.ArgumentParser()
    settings_arguments(parser)
    assert getattr(parser.parse_args([flag_name(old), "32"]), new) == "32"
    assert flag_name(old) in README.read_text() and env_name(old) in README.read_text()


@pytest.mark.parametrize("gpu", [True, False])
def test_device_auto_is_cuda_exactly_when_torch_sees_a_gpu(monkeypatch: pytest.MonkeyPatch, gpu: bool) -> None:
    import torch

    from server.config.settings import device_default

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    expected = "cuda" if gpu else "cpu"
    assert Settings().device == expected
    assert Settings(device="auto").device == expected
    monkeypatch.setenv("EMBERSERVE_DEVICE", "AUTO")
    assert Settings().device == expected
    assert Settings(device="cpu").device == "cpu" and Settings(device="cuda:1").device == "cuda:1"
    # the device's defaults follow the device chosen
    assert device_default(Settings(), "max_num_seqs") == (256 if gpu else 32)
