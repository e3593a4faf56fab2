"""A live beam step never makes the host wait for the device.

Under async scheduling (the CUDA default) the engine schedules step N + 1
while step N runs on the device; the beam step runs in the sampler, on the
engine's thread. An operation that waits for the device there (a blocking
copy from host memory, ``.item()``, an output whose size depends on the
data) holds the host until the step's forward is done, and the device then
idles while the next step is prepared. On CUDA the test runs a live step
with the device's sync check raising; on a CPU it checks the fixed-shape
path (the one an accelerator takes) for operations that would wait there.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_kvreuse.beam.catalog.trie import SidCatalog
from vllm_kvreuse.beam.plan import GroupStep
from vllm_kvreuse.beam.worker import job as beam_job
from vllm_kvreuse.beam.worker.job import BeamJob
from vllm_kvreuse.beam.worker.segments import cached_layout
from vllm_kvreuse.device.block_copy import copy_blocks_indexed

NUM_BLOCKS, WIDTH, VOCAB, EOS = 64, 6, 300, 2

WAITING = frozenset(
    {"nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique2"}
)
"""Operations whose result the host must read (or size) before going on."""


class _Waits(TorchDispatchMode):
    """Names every operation of the step that would wait for a device."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.paused = False  # inside a check that runs on CPU only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        if self.paused:
            pass
        elif name in WAITING:
            self.found.append(name)
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 else ())
            if i is not None
        ):
            self.found.append(f"{name} by a mask")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.found.append("repeat_interleave without its size")
        return func(*args, **kwargs)


def _live_step(
    device: torch.device, eos: int, catalog: str | None, step_context
) -> None:
    """A group's first step, then a live one inside ``step_context``, as a
    worker runs them: logits rows, sampled tokens, private blocks copied
    in a real cache tensor on ``device``; ``catalog``: None, "dense" or
    "csr" (the trie's two level layouts)."""
    rng = np.random.default_rng(0)
    members = [f"m{i}" for i in range(WIDTH)]
    row_of = {m: i for i, m in enumerate(members)}
    cache = torch.zeros(NUM_BLOCKS, 4, 8, device=device)

    def copy(src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_blocks_indexed([cache], NUM_BLOCKS, src, dst)

    sid = None
    if catalog is not None:
        items = rng.integers(3, VOCAB, size=(40, 3))
        dense = 10**6 if catalog == "dense" else 0
        sid = SidCatalog.from_items(items, VOCAB, dense_max_entries=dense).to(device)
    states: dict = {}
    rule = dict(width=WIDTH, eos=eos, row_size=2 * WIDTH if eos >= 0 else WIDTH)
    first = dict(carriers=list(range(WIDTH)), cum_logprobs=[0.0] * WIDTH)
    if catalog is not None:
        first["nodes"] = [0] * WIDTH
    blocks = [[[10 + i, 20 + i] for i in range(WIDTH)]]
    for kind in ("start", "step"):
        step = GroupStep(
            "g", kind, members, catalog=catalog is not None, blocks=blocks,
            **rule, **(first if kind == "start" else {}),
        )  # fmt: skip
        logits = torch.from_numpy(rng.normal(size=(WIDTH, VOCAB))).float().to(device)
        sampled = torch.zeros(WIDTH, dtype=torch.long, device=device)
        job = BeamJob([step], states, lambda: sid, row_of, copy)
        if kind == "start":
            job.prepare(logits)
            job.finish(sampled)
            continue
        cached_layout.cache_clear()  # the layout is built inside the step
        with step_context():
            job.prepare(logits)
            job.finish(sampled)
    assert job.results["g"].next.shape[0] == WIDTH


CASES = pytest.mark.parametrize(
    "eos, catalog",
    [
        (-1, None),
        (EOS, None),
        (EOS, "dense"),
        (EOS, "csr"),
    ],
    ids=["plain", "eos", "catalog-dense", "catalog-csr"],
)


@CASES
def test_the_fixed_step_has_no_operation_that_waits(
    eos: int, catalog: str | None, monkeypatch
) -> None:
    """On a CPU, the path an accelerator takes (fixed shapes): no operation
    whose output the host must read or size. (What a CPU cannot show, a
    blocking copy from host memory, the CUDA test below does.)"""
    fixed = functools.partial(beam_job.select_rows, fixed=True)
    monkeypatch.setattr(beam_job, "select_rows", fixed)
    waits = _Waits()
    check = SidCatalog._check_nodes

    def on_cpu_only(self, nodes):  # skipped on an accelerator (its docstring)
        waits.paused = True
        try:
            return check(self, nodes)
        finally:
            waits.paused = False

    monkeypatch.setattr(SidCatalog, "_check_nodes", on_cpu_only)
    _live_step(torch.device("cpu"), eos, catalog, lambda: waits)
    assert waits.found == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@CASES
def test_a_live_step_on_cuda_never_syncs(eos: int, catalog: str | None) -> None:
    """The device's own check: any synchronising call raises (blocking
    host-to-device copies of the step's rows, layout and block ids did)."""

    class _Raising:
        def __enter__(self) -> None:
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc: object) -> None:
            torch.cuda.set_sync_debug_mode("default")

    _live_step(torch.device("cuda"), eos, catalog, _Raising)
