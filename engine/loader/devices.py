"""Whether a torch device named by a caller (a flag, a setting) exists on this machine, checked before a load."""
from __future__ import annotations

import torch

from engine.errors import DeviceError


def check_device(name: str) -> torch.device:
    """The device `name` names, or DeviceError saying why there is none here (not a device, no CUDA, no such GPU)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceError(f"device {name!r}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise DeviceError(f"device {name!r}: this torch was built without CUDA (the cpu device is available)")
        count = torch.cuda.device_count()
        if count == 0:
            raise DeviceError(f"device {name!r}: no CUDA GPU is visible (the cpu device is available)")
        if device.index is not None and device.index >= count:
            raise DeviceError(f"device {name!r}: there is no such GPU; this machine has {count} "
                              f"(cuda:0 to cuda:{count - 1})")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {name!r}: MPS is not available here (the cpu device is available)")
    return device
