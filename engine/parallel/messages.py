"""The step message: what rank 0 broadcasts to the other ranks before every forward pass, as one int64 tensor.

A message is a mode (run a step for logits or for hidden states, or stop), the KV blocks to copy first
(copy-on-write, engine/cache/block_manager.py) and the step's `ForwardBatch`, every field of it: the other ranks run the
same forward pass over their own KV pools, whose blocks are laid out alike, so they need no scheduler, block manager
or sampler of their own. The batch is flattened into a header of ints (scalars, and for each tensor its dtype and
shape) and the tensors' values, sent as [header | values] on the ranks' device after a [2] tensor of the two lengths:
two broadcasts a step, whatever its shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engine.model.batch import ForwardBatch

MODE_STOP, MODE_LOGITS, MODE_HIDDEN = 0, 1, 2
_DTYPES = (torch.int64, torch.int32, torch.bool)  # the dtypes of ForwardBatch's tensors: exact in int64
_NONE, _BOOL, _INT, _TENSOR, _LIST = range(5)


@dataclass
class StepMessage:
    mode: int
    copies: list[tuple[int, int]] = field(default_factory=list)  # KV blocks (source, destination) to copy first
    batch: ForwardBatch | None = None                             # None when stopping


def _encode(value: Any, header: list[int], values: list[torch.Tensor]) -> None:
    if value is None:
        header.append(_NONE)
    elif isinstance(value, bool):
        header += [_BOOL, int(value)]
    elif isinstance(value, int):
        header += [_INT, value]
    elif isinstance(value, torch.Tensor):
        header += [_TENSOR, _DTYPES.index(value.dtype), value.dim(), *value.shape]
        values.append(value.reshape(-1).to(torch.int64))
    elif isinstance(value, list):
        header += [_LIST, len(value)]
        for item in value:
            _encode(item, header, values)
    else:
        raise TypeError(f"a step message cannot carry {type(value).__name__}")


class _Reader:
    """Reads the fields back from a message's header (host ints) and values (a device tensor)."""

    def __init__(self, header: list[int], values: torch.Tensor) -> None:
        self.header, self.values, self.at, self.offset = header, values, 0, 0

    def int(self) -> int:
        self.at += 1
        return self.header[self.at - 1]

    def value(self) -> Any:
        tag = self.int()
        if tag == _NONE:
            return None
        if tag == _BOOL:
            return bool(self.int())
        if tag == _INT:
            return self.int()
        if tag == _TENSOR:
            dtype, dims = _DTYPES[self.int()], self.int()
            shape = [self.int() for _ in range(dims)]
            count = 1
            for size in shape:
                count *= size
            flat = self.values[self.offset:self.offset + count]
            self.offset += count
            return flat.view(shape).to(dtype)
        if tag == _LIST:
            return [self.value() for _ in range(self.int())]
        raise ValueError(f"corrupt step message: tag {tag} at {self.at - 1}")


def encode_step(message: StepMessage, device: torch.device) -> tuple[int, torch.Tensor]:
    """(header length, [header | values] as one int64 tensor on `device`)."""
    header = [message.mode, len(message.copies), *(b for pair in message.copies for b in pair)]
    values: list[torch.Tensor] = []
    if message.batch is not None:
        for item in message.batch:
            _encode(item, header, values)
    head = torch.tensor(header, dtype=torch.int64).to(device)
    return len(header), torch.cat([head, *(v.to(device) for v in values)]) if values else head


def decode_step(header_len: int, payload: torch.Tensor) -> StepMessage:
    """The message `encode_step` made, its tensors views of (or casts from) `payload`, on its device."""
    reader = _Reader(payload[:header_len].tolist(), payload[header_len:])
    mode, copies = reader.int(), reader.int()
    pairs = [(reader.int(), reader.int()) for _ in range(copies)]
    if mode == MODE_STOP:
        return StepMessage(mode, pairs)
    return StepMessage(mode, pairs, ForwardBatch(*(reader.value() for _ in ForwardBatch._fields)))


def send_step(message: StepMessage, group: dist.ProcessGroup, device: torch.device) -> None:
    """Broadcast `message` from rank 0 (the caller) to every rank of `group`."""
    header_len, payload = encode_step(message, device)
    sizes = torch.tensor([header_len, payload.numel()], dtype=torch.int64).to(device)
    dist.broadcast(sizes, src=0, group=group)
    dist.broadcast(payload, src=0, group=group)


def receive_step(group: dist.ProcessGroup, device: torch.device) -> StepMessage:
    """The next message rank 0 broadcasts over `group` (blocks until it comes)."""
    sizes = torch.empty(2, dtype=torch.int64, device=device)
    dist.broadcast(sizes, src=0, group=group)
    header_len, total = sizes.tolist()
    payload = torch.empty(total, dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0, group=group)
    return decode_step(header_len, payload)
