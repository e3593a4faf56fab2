"""What the GPU report runs: models, servers, sizes, budgets, targets.

One :class:`Plan` for a GPU (what the figures are measured with) and one for
the dry run on a CPU (the same sections with the tiny model and small
sizes). Budgets are wall-clock seconds: each section has its own, cut to
what is left of the whole run's :data:`WHOLE_RUN` (8 minutes, inside a
device call's 10), so a section that overruns takes time from the later
ones, never from the call. A dry run has none: it proves that every
section produces its table, on a machine of any speed, so nothing in it is
cut by the clock.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvreuse.testing.server import Server, ServerSettings
from vllm_kvreuse.testing.server_group import ServerSpec, StartTimes
from vllm_kvreuse.testing.tiny_model import PRESETS

GIB = 2**30
WHOLE_RUN = 480.0
"""Seconds the whole report may take on a GPU (the sections' own budgets
sum to more: a section that finishes early leaves its time to the rest)."""
SECTION_TITLES = (
    ("rag", "RAG: chunk cache against plain vLLM"),
    ("beams", "Beams: engine and catalog beams against vLLM's beam search"),
    ("two_stage", "Two-stage (OpenOneRec)"),
)


@dataclass(frozen=True)
class RagShape:
    """One RAG prompt shape: documents a prompt, tokens a document, and
    requests a phase (fewer where prompts are long)."""

    documents: int
    doc_tokens: int
    requests: int

    @property
    def label(self) -> str:
        """The prompt's size, e.g. ``4K`` (documents only, rounded)."""
        tokens = self.documents * self.doc_tokens
        return f"{round(tokens / 1000)}K" if tokens >= 1000 else str(tokens)

    @property
    def stored_tokens(self) -> int:
        """Document tokens a run of this shape stores (cold: every document
        new, mixed: half)."""
        k = self.documents
        return self.requests * (k + k // 2) * self.doc_tokens


@dataclass(frozen=True)
class Sizes:
    """The workload of each section."""

    rag_shapes: tuple[RagShape, ...]
    beam_args: dict
    two_stage_args: dict
    micro_argv: list[str]
    beam_steps: dict[str, str]  # overhead / profile / select: their scripts' arguments


GPU_SIZES = Sizes(
    # About 4K, 16K and 32K tokens, the 7B shape.
    rag_shapes=(RagShape(4, 1000, 8), RagShape(8, 2000, 3), RagShape(8, 4000, 2)),
    # The RecIF-like shape benchmarks/sid_beams.py documents for a GPU.
    beam_args=dict(
        prompt_tokens=2500,
        codebook=8192,
        token_base=600,
        items=100_000,
        widths=[50, 512],
        saturation_widths=[50],
        concurrency=[16],
        per_client=2,
        repeats=1,
        seed=0,
    ),
    two_stage_args=dict(
        requests=16, concurrency=4, prompt_words=260, thinking_tokens=128, beam_width=32
    ),
    micro_argv=[
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--repeats",
        "20",
        "--tokens",
        "16",
        "4096",
        "16384",
    ],
    beam_steps=dict(
        overhead=(
            "--model models/small --sync --dtype bfloat16 --widths 50 --searches 16 "
            "--repeats 1 --lp-max-width 0 --kv-cache-mib 8192"
        ),
        profile=(
            "--model models/small --dtype bfloat16 --top 0 --widths 50 --searches 16 "
            "--repeats 2 --ignore-eos --step-times --step-parts --prompt-tokens 2500"
        ),
        select="--device cuda --groups 16 --width 50 --vocab 32768",
    ),
)
DRY_SIZES = Sizes(
    rag_shapes=(RagShape(4, 120, 2), RagShape(8, 100, 1)),
    beam_args=dict(
        prompt_tokens=64,
        codebook=1024,
        token_base=600,
        items=2000,
        widths=[4, 16],
        saturation_widths=[4],
        concurrency=[2],
        per_client=1,
        repeats=1,
        seed=0,
    ),
    two_stage_args=dict(
        requests=2, concurrency=2, prompt_words=20, thinking_tokens=8, beam_width=4
    ),
    micro_argv=["--device", "cpu", "--tokens", "64", "--repeats", "2", "--warmup", "1"],
    beam_steps=dict(
        overhead=(
            "--widths 4 --searches 2 --repeats 1 --steps 2 --lp-max-width 0 "
            "--kv-cache-mib 64"
        ),
        profile=(
            "--top 0 --widths 4 --searches 2 --repeats 1 --ignore-eos --step-times "
            "--step-parts --prompt-tokens 64 --kv-cache-mib 64"
        ),
        select="--device cpu --groups 2 --width 4 --vocab 4096 --repeats 2",
    ),
)


@dataclass
class Plan:
    dry_run: bool
    work: Path
    sizes: Sizes
    rag_model: str
    beam_model: str
    budgets: dict[str, float]
    """Seconds: ``start`` (models built and servers ready; ``correctness``
    runs beside it), then each measured section's. Empty in a dry run."""
    kv_bytes: dict[str, int]
    doc_words: list[int] = field(default_factory=list)  # per RAG shape
    store_fraction: float = 0.1
    store_note: str = ""
    catalog: Path = field(init=False)

    @classmethod
    def make(cls, dry_run: bool, work: Path) -> Plan:
        work.mkdir(parents=True, exist_ok=True)
        if dry_run:
            plan = cls(
                True,
                work,
                DRY_SIZES,
                "models/tiny",
                "models/tiny",
                {},
                kv_bytes={},
            )
        else:
            plan = cls(
                False,
                work,
                GPU_SIZES,
                "models/7b",
                "models/small",
                dict(
                    start=200,
                    correctness=180,
                    rag=150,
                    beams=90,
                    two_stage=50,
                    micro=60,
                    beam_steps=100,
                ),
                kv_bytes={"models/7b": 3 * GIB, "models/small": 3 * GIB // 2},
            )
        plan.catalog = work / "catalog.txt"
        plan.logs.mkdir(exist_ok=True)
        import argparse

        import sid_beams

        sid_beams.write_catalog(
            plan.catalog, argparse.Namespace(**plan.sizes.beam_args)
        )
        return plan

    @property
    def total(self) -> float | None:
        """The whole run's budget: start-up (correctness beside it), the
        measured sections, the device line and the summary; None: none."""
        if not self.budgets:
            return None
        sections = sum(v for k, v in self.budgets.items() if k != "correctness")
        return min(WHOLE_RUN, sections + 20)

    @property
    def ready_timeout(self) -> float:
        """Seconds the servers have to be ready (a dry run's servers start
        together on however few cores the machine has: an hour)."""
        return self.budgets.get("start", 3600.0)

    @property
    def logs(self) -> Path:
        return self.work / "servers"

    @property
    def models(self) -> dict[str, str]:
        """Model directory -> preset (tiny first: the tests need it)."""
        presets = {"models/tiny": "tiny", "models/small": "small", "models/7b": "7b"}
        wanted = ["models/tiny", self.beam_model, self.rag_model]
        return {d: presets[d] for d in dict.fromkeys(wanted)}

    @property
    def test_models(self) -> list[str]:
        return ["models/tiny"]

    measured = SECTION_TITLES

    def settings(self, model: str) -> ServerSettings:
        if self.dry_run:
            return ServerSettings.for_device()
        return ServerSettings(
            dtype="auto", enforce_eager=False, kv_cache_bytes=self.kv_bytes[model]
        )

    @property
    def rag_model_len(self) -> int:
        """The RAG servers' ``--max-model-len``: the longest shape's documents
        plus room for the prompt around them and the answer. Raises if the
        RAG model's preset has fewer positions (vLLM would refuse to start
        its servers, and the RAG section would not run)."""
        longest = max(s.documents * s.doc_tokens for s in self.sizes.rag_shapes)
        length = longest + 2048
        positions = PRESETS[self.models[self.rag_model]].max_positions
        if length > positions:
            raise ValueError(
                f"the RAG shapes need --max-model-len {length}, more than the "
                f"{positions} positions of {self.rag_model}"
            )
        return length

    def common_args(self, model: str) -> list[str]:
        if model == self.rag_model and not self.dry_run:
            return [
                "--max-model-len",
                str(self.rag_model_len),
                "--max-num-batched-tokens",
                "8192",
                "--max-num-seqs",
                "32",
            ]
        return [
            "--max-model-len",
            "4096",
            "--max-num-batched-tokens",
            "8192",
            "--max-logprobs",
            "1025",
        ]

    def roles(self) -> dict[str, tuple[str, list[str]]]:
        """Role -> (model, plugin flags). Roles with the same model and
        flags share a server: the dry run's plain servers, and its chunk
        cache, continuation and engine beam servers (one server with the
        three features, as the soak runs them, whose requests each ask for
        what they use; on a CPU each server start costs about 25 s of the
        test suite's two cores)."""
        fraction = ["--chunk-cache-device-fraction", f"{self.store_fraction:.3f}"]
        retain = ["--enable-continuation", "--retain-kv-max-fraction", "0.25"]
        catalog = [
            "--sid-catalog",
            str(self.catalog),
            "--logprobs-mode",
            "processed_logprobs",
        ]
        chunk = ["--enable-chunk-cache", *fraction]
        continuation = retain
        engine = ["--engine-beam-search", *retain]
        if self.dry_run:
            chunk = continuation = engine = [*chunk, "--engine-beam-search", *retain]
        return {
            "rag_plain": (self.rag_model, []),
            "rag_chunk": (self.rag_model, chunk),
            "plain": (self.beam_model, []),
            "continuation": (self.beam_model, continuation),
            "engine": (self.beam_model, engine),
            "catalog": (self.beam_model, ["--engine-beam-search", *catalog]),
        }

    def server_of(self, role: str) -> str:
        """The name of the server that plays ``role``."""
        model, flags = self.roles()[role]
        for name, (other_model, other_flags) in self.roles().items():
            if (other_model, other_flags) == (model, flags):
                return name
        raise KeyError(role)

    def servers(self) -> list[ServerSpec]:
        names = dict.fromkeys(self.server_of(role) for role in self.roles())
        specs = []
        for name in names:
            model, flags = self.roles()[name]
            specs.append(
                ServerSpec(
                    name,
                    model,
                    [*self.common_args(model), *flags],
                    env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache
                    settings=self.settings(model),
                )
            )
        return specs

    def budget(self, name: str, begin: float) -> float | None:
        """A section's budget, cut to what is left of the whole run's (None
        in a dry run: no limit)."""
        if self.total is None:
            return None
        left = self.total - (time.monotonic() - begin)
        return max(10.0, min(self.budgets[name], left))

    def config(self, name: str, servers: dict[str, Server]) -> dict:
        """What a section's process needs (raises KeyError for a server that
        did not start)."""

        def url(role: str) -> str:
            return servers[self.server_of(role)].url

        sizes = self.sizes
        if name == "rag":
            shapes = [
                dict(
                    label=shape.label,
                    docs_per_prompt=shape.documents,
                    doc_words=words,
                    requests=shape.requests,
                    concurrency=1,
                    warm_recompute=['"none"'],
                    warm_attention=["paths", "choose"],
                )
                for shape, words in zip(sizes.rag_shapes, self.doc_words, strict=True)
            ]
            return {
                "plain": url("rag_plain"),
                "chunk": url("rag_chunk"),
                "shapes": shapes,
            }
        if name == "beams":
            return {
                "args": dict(sizes.beam_args, model=self.beam_model),
                "urls": {m: url(m) for m in ("plain", "engine", "catalog")},
            }
        if name == "two_stage":
            args = dict(sizes.two_stage_args, block_size=32, kv_blocks=0)
            return {
                "continuation": url("continuation"),
                "engine": url("engine"),
                "args": args,
            }
        if name == "beam_steps":
            return sizes.beam_steps
        return {"argv": sizes.micro_argv}

    def describe(self, times: StartTimes, servers: dict[str, Server]) -> str:
        """The start-up section: servers, their flags and sizes, times."""
        lines = [
            "| server | model | flags | KV cache | started | ready |",
            "|---|---|---|---:|---:|---:|",
        ]
        for spec in self.servers():
            kv = self.kv_bytes.get(spec.model_dir)
            flags = " ".join(self.roles()[spec.name][1]) or "(plain vLLM)"
            started = times.started.get(spec.name)
            ready = times.ready.get(spec.name)
            lines.append(
                f"| {spec.name} | {spec.model_dir} | {flags} | "
                f"{f'{kv / GIB:.1f} GiB' if kv else 'default'} | "
                f"{f'{started:.0f} s' if started is not None else '-'} | "
                f"{f'{ready:.0f} s' if ready is not None else 'not ready'} |"
            )
        backends = set()
        for server in servers.values():
            backends |= set(
                re.findall(
                    r"Using (\S+) (?:attention )?backend", server.log_tail(1 << 20)
                )
            )
        lines += [
            "",
            f"Servers: {times.summary()}. Attention backends logged: "
            f"{', '.join(sorted(backends)) or 'none found'}.",
            f"Chunk store: {self.store_note}.",
        ]
        return "\n".join(lines)

    def size_store(self) -> None:
        """Sizes the RAG documents and the chunk store so that the store
        holds every document of the largest shape's run (with a quarter to
        spare; each shape's documents are its own, so an earlier shape's
        may go). Every preset shares one tokenizer: the tiny model's is read."""
        import rag_chunk_cache
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained("models/tiny")
        sample = rag_chunk_cache.document(0, 200)
        tokens_per_word = len(tokenizer(sample)["input_ids"]) / 200
        preset = PRESETS[self.models[self.rag_model]]
        dtype_bytes = 4 if self.dry_run else 2  # served float32 on CPU, else bf16
        bytes_per_token = (
            2 * preset.num_layers * preset.num_kv_heads * preset.head_dim * dtype_bytes
        )
        shapes = self.sizes.rag_shapes
        self.doc_words = [max(8, round(s.doc_tokens / tokens_per_word)) for s in shapes]
        stored = max(s.stored_tokens for s in shapes)
        needed = stored * bytes_per_token * 1.25
        kv = self.kv_bytes.get(self.rag_model, GIB)
        if needed / 0.6 > kv and self.rag_model in self.kv_bytes:  # a larger cache:
            # the store takes at most 60%, the rest runs the longest prompts
            kv = self.kv_bytes[self.rag_model] = -(-int(needed / 0.6) // 2**20) * 2**20
        self.store_fraction = min(1.0, needed / kv)
        self.store_note = (
            f"{stored} document tokens (the largest shape's run) x "
            f"{bytes_per_token} B/token x 1.25 = {needed / 2**20:.0f} MiB: "
            f"--chunk-cache-device-fraction {self.store_fraction:.3f} of a "
            f"{kv / GIB:.1f} GiB KV cache"
        )
