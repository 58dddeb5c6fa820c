"""A device that is not on this machine is refused by name before anything loads."""
from __future__ import annotations

import pytest
import torch

from engine import DeviceError, load_runner
from engine.loader.devices import check_device


def test_the_cpu_is_always_there() -> None:
    assert check_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "gpu0", ""])
def test_a_name_that_is_no_device(name: str) -> None:
    with pytest.raises(DeviceError, match="not a torch device"):
        check_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_before_the_load() -> None:
    for name in ("cuda", "cuda:1"):
        with pytest.raises(DeviceError, match=f"device '{name}'"):
            check_device(name)
    with pytest.raises(DeviceError):  # before reading any weights: the model need not even exist
        load_runner("/no/such/model.gguf", device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_index_past_the_last_is_refused() -> None:
    count = torch.cuda.device_count()
    assert check_device(f"cuda:{count - 1}").index == count - 1
    with pytest.raises(DeviceError, match=f"this machine has {count}"):
        check_device(f"cuda:{count}")
