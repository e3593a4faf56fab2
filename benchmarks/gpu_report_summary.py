"""The GPU report's summary: each target checked against what was measured
(:mod:`gpu_report_plan` holds the sections; ``docs/benchmarks.md`` the
targets' reasons)."""

from __future__ import annotations

import json

from gpu_report_plan import SECTION_TITLES, Plan

STEPS = "Beam steps: where a step's time goes"


def rag_checks(shapes: dict[str, dict[str, float]]) -> list[tuple]:
    """The RAG targets at each prompt shape (the first, about 4K tokens,
    has the looser default target; the longest must gain 10x cold)."""
    checks: list[tuple] = []
    for number, (label, ttft) in enumerate(shapes.items()):
        cold, hit = ttft["plain, cold"], ttft["plain, prefix hit"]
        bound = 1.5 if number == 0 else 1.25
        checks += [
            (
                f"RAG {label}: default TTFT / prefix hit",
                ttft["chunk cache, default recompute"] / hit,
                f"<= {bound}",
                lambda v, bound=bound: v <= bound,
            ),
            (
                f'RAG {label}: "none" TTFT / prefix hit',
                ttft['chunk cache, chunk_recompute "none"'] / hit,
                "<= 1.1",
                lambda v: v <= 1.1,
            ),
            (
                f"RAG {label}: first sight TTFT / plain cold",
                ttft["chunk cache, first sight"] / cold,
                "<= 1.05",
                lambda v: v <= 1.05,
            ),
        ]
    if shapes:
        label, ttft = list(shapes.items())[-1]
        checks.append(
            (
                f"RAG {label}: plain cold / default TTFT",
                ttft["plain, cold"] / ttft["chunk cache, default recompute"],
                ">= 10x",
                lambda v: v >= 10,
            )
        )
    return checks


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
        *rag_checks(get(rag, "shapes") or {}),
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
            "a step of 16 beam groups: host time / their members decoding",
            get(STEPS, "host_beams_over_decode"),
            "(reported)",
            None,
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
