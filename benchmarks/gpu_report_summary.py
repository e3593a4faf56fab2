"""The GPU report's summary: each target checked against what was measured
(:mod:`gpu_report_plan` holds the sections; ``docs/benchmarks.md`` the
targets' reasons)."""

from __future__ import annotations

import json

from gpu_report_plan import SECTION_TITLES, Plan


def summary(results: dict, seconds: float, plan: Plan) -> str:
    """The targets of the GPU report, checked against what was measured."""

    def get(section: str, *keys: str) -> float | None:
        value = results.get(section)
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    rag, beams, two = (t for _, t in SECTION_TITLES)
    micro = "Chunk load against copy bandwidth"
    shares = get(micro, "share_of_copy") or {}
    load_4k = [v for k, v in shares.items() if k.endswith(" 4096 triton load")]
    checks = [
        (
            "whole run",
            seconds,
            f"<= {plan.total:.0f} s" if plan.total else "(a dry run has no budget)",
            seconds <= plan.total if plan.total else None,
        ),
        (
            "RAG warm TTFT, plain / ours, chunk_recompute none",
            get(rag, "warm_none"),
            ">= 10x",
            lambda v: v >= 10,
        ),
        (
            "RAG warm TTFT, plain / ours, default",
            get(rag, "warm_default"),
            "reported",
            None,
        ),
        (
            "RAG first sight, plain / ours",
            get(rag, "first_sight"),
            ">= 1/1.05",
            lambda v: v >= 1 / 1.05,
        ),
        (
            "catalog beams QPS / vLLM beam search QPS, width 50",
            get(beams, "catalog_over_plain"),
            ">= 7x",
            lambda v: v >= 7,
        ),
        (
            "illegal SIDs, catalog mode",
            get(beams, "illegal_catalog"),
            "0%",
            lambda v: v == 0,
        ),
        (
            "two-stage (d) wall / stage 1 alone",
            get(two, "d_over_stage1"),
            "<= 1.10",
            lambda v: v <= 1.10,
        ),
        (
            "chunk load, share of copy bandwidth, 4K tokens (worst shape)",
            min(load_4k) if load_4k else None,
            ">= 70%",
            lambda v: v >= 0.70,
        ),
    ]
    lines = ["| target | measured | wanted | met |", "|---|---:|---|---|"]
    for name, value, wanted, check in checks:
        if value is None:
            lines.append(f"| {name} | not measured | {wanted} | - |")
            continue
        met = check if isinstance(check, bool) or check is None else check(value)
        shown = f"{value:.2f}" if isinstance(value, float) else json.dumps(value)
        lines.append(
            f"| {name} | {shown} | {wanted} | "
            f"{'-' if met is None else 'yes' if met else 'no'} |"
        )
    return "\n".join(lines)
