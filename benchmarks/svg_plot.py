"""A line chart as a standalone SVG file, with no plotting library.

The benchmarks write their plots with this so that the docs can show them
without adding matplotlib to the environment. Axes are logarithmic (base 2
for x, base 10 for y) because the benchmarks sweep widths and latencies over
orders of magnitude.
"""

from __future__ import annotations

import math
from pathlib import Path

WIDTH, HEIGHT = 760, 400
LEFT, RIGHT, TOP, BOTTOM = 70, 230, 40, 50
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def line_chart(
    series: dict[str, list[tuple[float, float]]],
    path: str | Path,
    title: str,
    x_label: str,
    y_label: str,
) -> None:
    """Writes ``series`` (name -> (x, y) points, all positive) to ``path``."""
    points = [p for values in series.values() for p in values]
    xs = [math.log2(x) for x, _ in points]
    ys = [math.log10(y) for _, y in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys))
    y1 = y1 if y1 > y0 else y0 + 1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(x: float, y: float) -> tuple[float, float]:
        px = LEFT + (math.log2(x) - x0) / (x1 - x0) * plot_w
        py = TOP + plot_h - (math.log10(y) - y0) / (y1 - y0) * plot_h
        return px, py

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" '
        f'font-size="14">{title}</text>',
    ]
    for x in sorted({x for x, _ in points}):  # x ticks at the measured widths
        px, _ = at(x, 10**y0)
        out.append(f'<line x1="{px:.1f}" y1="{TOP}" x2="{px:.1f}" '
                   f'y2="{TOP + plot_h}" stroke="#eee"/>')  # fmt: skip
        out.append(f'<text x="{px:.1f}" y="{TOP + plot_h + 18}" '
                   f'text-anchor="middle">{x:g}</text>')  # fmt: skip
    for e in range(y0, y1 + 1):  # y ticks at powers of ten
        _, py = at(2**x0, 10**e)
        out.append(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{LEFT + plot_w}" '
                   f'y2="{py:.1f}" stroke="#eee"/>')  # fmt: skip
        out.append(f'<text x="{LEFT - 6}" y="{py + 4:.1f}" '
                   f'text-anchor="end">{10**e:g}</text>')  # fmt: skip
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" '
               'fill="none" stroke="#333"/>')  # fmt: skip
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" '
               f'text-anchor="middle">{x_label}</text>')  # fmt: skip
    out.append(f'<text transform="translate(18,{TOP + plot_h / 2}) rotate(-90)" '
               f'text-anchor="middle">{y_label}</text>')  # fmt: skip
    for i, (name, values) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = [at(x, y) for x, y in sorted(values)]
        line = " ".join(f"{px:.1f},{py:.1f}" for px, py in coords)
        out.append(f'<polyline points="{line}" fill="none" stroke="{color}" '
                   'stroke-width="2"/>')  # fmt: skip
        out += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"/>'
                for px, py in coords]  # fmt: skip
        ly = TOP + 16 + 18 * i
        out.append(f'<line x1="{WIDTH - RIGHT + 12}" y1="{ly - 4}" '
                   f'x2="{WIDTH - RIGHT + 32}" y2="{ly - 4}" stroke="{color}" '
                   'stroke-width="2"/>')  # fmt: skip
        out.append(f'<text x="{WIDTH - RIGHT + 38}" y="{ly}">{name}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n")
