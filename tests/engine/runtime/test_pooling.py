"""engine/runtime/pooling.py against a per-sequence loop, and the pooling read from sentence-transformers configs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.runtime.pooling import pool, sentence_transformers_pooling


def _reference(hidden: torch.Tensor, lengths: list[int], mode: str) -> torch.Tensor:
    out, start = [], 0
    for n in lengths:
        rows = hidden[start:start + n].double()
        vec = {"mean": rows.mean(0), "last": rows[-1], "cls": rows[0]}[mode]
        out.append(vec / vec.norm())
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("mode", ["mean", "last", "cls"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pooling_matches_a_loop_over_sequences(mode: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 7, 3, 12, 1, 5]
    hidden = (torch.randn(sum(lengths), 24, generator=gen) * 3).to(dtype)
    got = pool(hidden, lengths, mode)
    assert got.dtype == torch.float32 and got.shape == (len(lengths), 24)
    torch.testing.assert_close(got.double(), _reference(hidden.float(), lengths, mode), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(lengths)))


def test_pooling_refuses_what_it_cannot_pool() -> None:
    hidden = torch.randn(4, 8)
    with pytest.raises(ValueError, match="unknown pooling"):
        pool(hidden, [4], "max")
    with pytest.raises(ValueError, match="4 hidden states for sequences of 5"):
        pool(hidden, [2, 3], "mean")
    with pytest.raises(ValueError, match="at least one token"):
        pool(hidden, [4, 0], "mean")


def _st_dir(tmp_path: Path, pooling: dict | None) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    return tmp_path


@pytest.mark.parametrize("config, expected", [
    ({"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode": "cls"}, "cls"),
    ({"pooling_mode": "lasttoken"}, "last"),
    ({"pooling_mode_max_tokens": True}, None),
])
def test_the_pooling_a_sentence_transformers_model_declares(tmp_path: Path, config: dict, expected: str) -> None:
    assert sentence_transformers_pooling(_st_dir(tmp_path, config)) == expected


def test_no_sentence_transformers_config_means_no_declared_pooling(tmp_path: Path) -> None:
    assert sentence_transformers_pooling(tmp_path) is None
    assert sentence_transformers_pooling(_st_dir(tmp_path, None)) is None
