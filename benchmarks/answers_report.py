"""Tables of one- and two-document questions from chunk_reuse_reference.py.

Reads the results files of ``chunk_reuse_reference.py --pairs`` (one per
document kind) and prints, per mode and question kind, first sight and
warm: accuracy, the paired difference to full attention with its 95%
interval by question (and, in brackets, clustered by prompt), and the mean
number of documents kept (``choose`` modes). Then the default rule of
issue 44: a mode may become the default only if in every cell (question
kind x document kind x first sight/warm) its paired difference has a point
estimate >= 0 and a 95% lower bound >= -5 points, on >= 200 questions.

Two-document questions (``pair_question``) are right when the answer names
both towns and no other document's: naming two of the prompt's four towns
at random is right 1 in 6 times (the guessing rate).

    .venv/bin/python benchmarks/answers_report.py \\
        profiles=docs/results/answers_profiles.json \\
        sheets=docs/results/answers_sheets.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from quality_report import clustered, paired

GUESS = 1 / 6  # two of four towns, at random
RULE_MIN = 200  # questions a cell


def kinds(results: dict) -> dict[str, bool]:
    """key -> whether it is a two-document question (``SET.PROMPT.J``: the
    one-document questions come first, ``per_doc`` per document of 4)."""
    per_doc = results.get("_args", {}).get("per_doc", 1)
    keys = {k for mode, done in results.items() if mode != "_args" for k in done}
    return {k: int(k.rsplit(".", 1)[1]) >= 4 * per_doc for k in keys}


def cell(done: dict, full: dict, keys: list[str], mode: str) -> dict:
    """Accuracy, paired difference (95% by question and by prompt) and the
    documents kept, over ``keys``."""
    mine = [done[k][0] for k in keys]
    out = {"n": len(keys), "right": sum(mine)}
    kept = [done[k][3] for k in keys if len(done[k]) > 3]
    out["kept"] = statistics.mean(kept) if kept else None
    if mode != "full" and len(keys) > 1:
        theirs = [full[k][0] for k in keys]
        out["diff"], out["half"] = paired(mine, theirs)
        _, out["by"] = clustered(mine, theirs, [k.rsplit(".", 1)[0] for k in keys])
    return out


def cells(results: dict, modes: list[str]) -> dict:
    """(mode, two, when) -> cell, ``when`` "c" (first sight) or "w"."""
    full, two_doc = results.get("full", {}), kinds(results)
    out = {}
    for mode in modes:
        done = results.get(mode, {})
        for two in (False, True):
            for when in ("c", "w"):
                keys = sorted(k for k in done if k in full and two_doc[k] == two
                              and f".{when}" in k)  # fmt: skip
                if keys:
                    out[mode, two, when] = cell(done, full, keys, mode)
    return out


def text(c: dict | None) -> list[str]:
    if c is None:
        return ["-", "-", "-"]
    acc = f"{c['right'] / c['n']:.1%} ({c['right']}/{c['n']})"
    diff = "-"
    if "diff" in c:
        diff = f"{c['diff']:+.1%} ± {c['half']:.1%} (± {c['by']:.1%})"
    kept = "-" if c["kept"] is None else f"{c['kept']:.2f}"
    return [acc, diff, kept]


def table(name: str, results: dict, modes: list[str]) -> dict:
    got = cells(results, modes)
    print(f"\n{name}:\n")
    print("| mode | questions | first sight | vs full | kept | warm | vs full | kept |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        for two in (False, True):
            row = text(got.get((mode, two, "c"))) + text(got.get((mode, two, "w")))
            what = "two documents" if two else "one document"
            print(f"| {mode} | {what} | {' | '.join(row)} |")
    return got


def rule(every: dict[str, dict], modes: list[str]) -> None:
    """Issue 44's default rule, per mode, over every cell."""
    print("\n| mode | worst point estimate | worst 95% lower bound | fewest "
          "questions a cell | passes the default rule |")  # fmt: skip
    print("|---|---|---|---|---|")
    for mode in modes:
        if mode == "full":
            continue
        mine = [c for got in every.values() for (m, _, _), c in got.items()
                if m == mode and "diff" in c]  # fmt: skip
        if len(mine) < 8:
            print(f"| {mode} | - | - | - | no (cells missing) |")
            continue
        point = min(c["diff"] for c in mine)
        low = min(c["diff"] - c["half"] for c in mine)
        fewest = min(c["n"] for c in mine)
        ok = point >= 0 and low >= -0.05 and fewest >= RULE_MIN
        print(f"| {mode} | {point:+.1%} | {low:+.1%} | {fewest} | "
              f"{'yes' if ok else 'no'} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="KIND=results.json")
    parser.add_argument("--modes", nargs="+", help="default: every mode, full first")
    args = parser.parse_args()
    every = {}
    for spec in args.files:
        name, _, path = spec.partition("=")
        results = json.loads(Path(path).read_text())
        others = sorted(m for m in results if m not in ("full", "_args"))
        modes = args.modes or ["full", *others]
        every[name] = table(name, results, modes)
        full = [every[name].get(("full", True, when)) for when in "cw"]
        right = sum(c["right"] for c in full if c)
        total = sum(c["n"] for c in full if c)
        if total:
            print(f"\nfull attention, two documents: {right}/{total} = "
                  f"{right / total:.1%}; guessing {GUESS:.1%}; "
                  f"{right / total - GUESS:+.1%} points")  # fmt: skip
    rule(every, args.modes or modes)


if __name__ == "__main__":
    main()
