"""Intervals and trade-off tables of the chunk cache's quality benchmarks."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence


def wilson(right: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% for z = 1.96)."""
    if not total:
        return 0.0, 1.0
    p = right / total
    scale = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / scale
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total**2)) / scale
    return max(0.0, centre - half), min(1.0, centre + half)


def paired(mode: Sequence[bool], plain: Sequence[bool]) -> tuple[float, float]:
    """Mean paired difference (mode - plain) and its 95% half-width."""
    diffs = [int(m) - int(p) for m, p in zip(mode, plain, strict=True)]
    mean = statistics.mean(diffs)
    half = (
        1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0
    )
    return mean, half


def clustered(
    mode: Sequence[bool], plain: Sequence[bool], clusters: Sequence[str]
) -> tuple[float, float]:
    """Mean paired difference and its 95% half-width with questions on one
    prompt as one cluster (they share its KV, so their errors correlate):
    the cluster-robust variance of a mean."""
    diffs = [int(m) - int(p) for m, p in zip(mode, plain, strict=True)]
    mean = statistics.mean(diffs)
    sums: dict[str, float] = defaultdict(float)
    for diff, cluster in zip(diffs, clusters, strict=True):
        sums[cluster] += diff - mean
    count = len(sums)
    if count < 2:
        return mean, 0.0
    variance = count / (count - 1) * sum(s * s for s in sums.values()) / len(diffs) ** 2
    return mean, 1.96 * math.sqrt(variance)


def accuracy(right: Sequence[bool]) -> str:
    low, high = wilson(sum(right), len(right))
    return (
        f"{sum(right) / max(len(right), 1):.1%} ({sum(right)}/{len(right)}, "
        f"{low:.1%}-{high:.1%})"
    )


def against(
    right: Sequence[bool], plain: Sequence[bool] | None, clusters: Sequence[str]
) -> str:
    """The paired difference from plain vLLM: per question and, in brackets,
    clustered by prompt."""
    if plain is None or not right:
        return "-"
    mean, half = paired(right, plain)
    _, cluster_half = clustered(right, plain, clusters)
    return f"{mean:+.1%} ± {half:.1%} (± {cluster_half:.1%})"


def reuse_table(
    results: dict[str, list],
    warm: Sequence[bool],
    clusters: Sequence[str],
) -> dict[str, tuple[float, float]]:
    """Prints the reuse workload's trade-off table (first sight and warm
    apart, each against plain vLLM on the same token ids; TTFTs and their
    ratios to plain's) and returns mode -> (warm speed-up, warm accuracy)."""
    plain = results.get("plain")
    plain_warm = statistics.median(plain[1]) if plain else 0.0
    plain_cold = statistics.median(plain[2]) if plain else 0.0
    print(
        "\n| mode | first sight (Wilson 95%) | first sight vs full attention "
        "(paired 95%; by prompt) | warm (Wilson 95%) | warm vs full attention "
        "(paired 95%; by prompt) | first-sight TTFT p50 | mode / plain | "
        "warm TTFT p50 | plain / mode |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    points = {}
    for mode, (right, warm_ttfts, cold_ttfts) in results.items():
        parts = {}
        for phase in (False, True):
            keep = [n for n, w in enumerate(warm) if w == phase]
            mine = [right[n] for n in keep]
            theirs = [plain[0][n] for n in keep] if plain and mode != "plain" else None
            parts[phase] = (mine, against(mine, theirs, [clusters[n] for n in keep]))
        warm_p50, cold_p50 = (statistics.median(warm_ttfts),
                              statistics.median(cold_ttfts))  # fmt: skip
        speed = plain_warm / warm_p50 if plain_warm else 0.0
        print(
            f"| {mode} | {accuracy(parts[False][0])} | {parts[False][1]} | "
            f"{accuracy(parts[True][0])} | {parts[True][1]} | "
            f"{cold_p50 * 1e3:,.0f} ms | "
            f"{cold_p50 / plain_cold if plain_cold else 0:.2f}x | "
            f"{warm_p50 * 1e3:,.0f} ms | {speed:.2f}x |"
        )
        warm_right = parts[True][0]
        points[mode] = (speed, sum(warm_right) / max(len(warm_right), 1))
    return points


def fixed_table(
    results: dict[str, list], two_hop: Sequence[bool]
) -> dict[str, tuple[float, float]]:
    """Prints the fixed-order workload's trade-off table: accuracy, paired
    difference against plain vLLM with its 95% interval, warm TTFT and its
    ratio to plain's; returns mode -> (speed-up, one-document accuracy)."""
    plain = results.get("plain")
    plain_ttft = statistics.median(plain[1]) if plain else 0.0
    print(
        "\n| mode | accuracy, one document (Wilson 95%) | vs full attention "
        "(paired, 95%) | two documents | warm TTFT p50 | plain / mode |"
    )
    print("|---|---|---|---|---|---|")
    points = {}
    for mode, (right, ttfts, *_) in results.items():
        one = [r for r, two in zip(right, two_hop, strict=True) if not two]
        two = [r for r, two in zip(right, two_hop, strict=True) if two]
        low, high = wilson(sum(one), len(one))
        diff = "-"
        if plain and mode != "plain":
            plain_one = [r for r, t in zip(plain[0], two_hop, strict=True) if not t]
            mean, half = paired(one, plain_one)
            diff = f"{mean:+.1%} ± {half:.1%}"
        ttft = statistics.median(ttfts)
        ratio = plain_ttft / ttft if plain_ttft else 0.0
        print(
            f"| {mode} | {sum(one) / len(one):.1%} ({sum(one)}/{len(one)}, "
            f"{low:.1%}-{high:.1%}) | {diff} | "
            f"{sum(two) / max(len(two), 1):.1%} ({sum(two)}/{len(two)}) | "
            f"{ttft * 1e3:.0f} ms | {ratio:.2f}x |"
        )
        points[mode] = (ratio, sum(one) / len(one))
    return points


def plot(points: dict[str, tuple[float, float]], path: str, what: str) -> None:
    """Every mode as one point: accuracy against warm TTFT speed-up."""
    from svg_plot import line_chart  # benchmarks/ is on sys.path when run

    line_chart(
        {m: [(max(x, 1e-3), max(y, 1e-3))] for m, (x, y) in points.items()},
        path, "Chunk cache: answers against speed",
        "warm TTFT, plain vLLM / mode", f"accuracy ({what})",
    )  # fmt: skip
