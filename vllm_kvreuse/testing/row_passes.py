"""Which operations pass over a whole ``[R, V]`` tensor, and their bytes.

On an accelerator, the beam step's cost past its launches is the memory
its operations move over the logits rows: a dispatch mode that counts
them on any device (the tests pin the count, the benchmarks print it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class RowPasses(TorchDispatchMode):
    """Records each operation that reads or writes a tensor of at least
    half of ``shape``'s elements (views left out, and gathers and scatters,
    which touch a few elements a row): ``names`` in order, and ``bytes``,
    the sizes of those tensors summed."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.numel = shape[0] * shape[1] // 2
        self.names: list[str] = []
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.is_view or name in ("gather", "scatter", "scatter_"):
            return out
        outs = out if isinstance(out, tuple) else (out,)
        whole = [
            t for t in (*args, *outs)
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel
        ]  # fmt: skip
        if whole:
            self.names.append(name)
            self.bytes += sum(t.numel() * t.element_size() for t in whole)
        return out
