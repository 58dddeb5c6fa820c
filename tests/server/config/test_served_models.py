"""The models a multi-model server serves (server/config/served_models.py): --model repeated, --models and
EMBERSERVE_MODELS, --models-dir's files and directories, the ids and MODEL=alias pairs, and the one-line errors of
a start that cannot work. Real files under tmp_path; the server itself is tests/e2e/test_many_models.py."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.config.served_models import ServableModel, alias_of, models_in, servable_models
from server.config.settings import Settings
from server.launch.checks import CommandError, check_loadable
from server.launch.cli import main
from server.launch.flags import given_settings, settings_arguments


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _parsed(*argv: str) -> Settings:
    parser = argparse.ArgumentParser()
    settings_arguments(parser)
    return Settings(**given_settings(parser.parse_args(argv)))


def test_model_repeated_is_the_default_and_more_models(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _parsed("--model", "a", "--model", "b", "--models", "c,d")
    assert (s.model, s.models, s.serves_many) == ("a", ["b", "c", "d"], True)
    one = _parsed("--model", "a")
    assert (one.model, one.models, one.serves_many) == ("a", [], False)
    monkeypatch.setenv("EMBERSERVE_MODEL", "x")
    monkeypatch.setenv("EMBERSERVE_MODELS", "y, z")
    env = Settings()
    assert (env.model, env.models) == ("x", ["y", "z"])
    assert Settings(idle_unload=5).serves_many and Settings(models_dir=".").serves_many


def test_several_models_need_their_engine_processes_and_one_http_process() -> None:
    with pytest.raises(ValidationError, match="--no-engine-process"):
        Settings(models=["b"], engine_process=False)
    with pytest.raises(ValidationError, match="api_server_count 2 serves one model"):
        Settings(models=["b"], api_server_count=2, engine_process=True)


def test_a_models_directory_holds_gguf_files_and_model_directories(tmp_path: Path) -> None:
    for name in ("b.gguf", "a-00001-of-00002.gguf", "a-00002-of-00002.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    _model_dir(tmp_path / "c")
    (tmp_path / "empty").mkdir()
    assert models_in(tmp_path) == [str(tmp_path / n) for n in ("a-00001-of-00002.gguf", "b.gguf", "c")]


def test_ids_are_names_or_aliases_the_default_first(tmp_path: Path) -> None:
    tiny = _model_dir(tmp_path / "one" / "hf")
    found = tmp_path / "dir"
    _model_dir(found / "tiny-b")
    (found / "c.gguf").write_bytes(b"")
    s = Settings(model="smollm2-135m", models=[str(tiny), "smollm2-135m"], models_dir=str(found),
                 served_model_name=f"{tiny}=tiny-a, c.gguf=tiny-c")
    assert servable_models(s) == [ServableModel("smollm2-135m", "smollm2-135m"), ServableModel("tiny-a", str(tiny)),
                                  ServableModel("tiny-c", str(found / "c.gguf")),
                                  ServableModel("tiny-b", str(found / "tiny-b"))]
    plain = Settings(model="smollm2-135m", models=[str(tiny)], served_model_name="chat")
    assert [m.id for m in servable_models(plain)] == ["chat", "hf"]  # a plain alias is the default model's


def test_what_cannot_be_served_is_one_line(tmp_path: Path) -> None:
    a, b = _model_dir(tmp_path / "a" / "hf"), _model_dir(tmp_path / "b" / "hf")
    with pytest.raises(ValueError, match=r"two models would be served as 'hf'.*--served-model-name"):
        servable_models(Settings(model=str(a), models=[str(b)]))
    with pytest.raises(ValueError, match="alias to 'nope', not a served model"):
        servable_models(Settings(model=str(a), models=[str(b)], served_model_name=f"nope=x,{b}=y"))
    with pytest.raises(ValueError, match="not a directory"):
        servable_models(Settings(model=str(a), models_dir=str(tmp_path / "missing")))
    with pytest.raises(CommandError, match="not found: '/no/such.gguf'"):
        check_loadable(Settings(model=str(a), models=["/no/such.gguf"], device="cpu"))


def test_the_cli_refuses_a_start_that_cannot_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "smollm2-135m", "--models-dir", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_one_model_keeps_its_plain_alias_as_it_was() -> None:
    assert alias_of(Settings(served_model_name="my=model,x"), "runner") == "my=model,x"
    assert alias_of(Settings(served_model_name="chat"), "runner") == "chat"
    assert alias_of(Settings(model="smollm2-135m", served_model_name="smollm2-135m=chat"), "runner") == "chat"
    assert alias_of(Settings(), "runner") is None
