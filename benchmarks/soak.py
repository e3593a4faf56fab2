"""Soak: every feature on, a small KV pool, a random mix for a long while.

Starts `vllm serve` with every plugin feature on and a 192-block pool
(`vllm_kvreuse.testing.soak.run.SERVER_ARGS`), sends the issue-14 mix
(`vllm_kvreuse.testing.soak.mix`) from `--concurrency` workers for
`--duration` seconds, waits for the retention TTLs to pass and checks that
the KV pool empties, sends a plain and a RAG probe, and prints the summary.
The summary (markdown) replaces the results section of `--out`.

    .venv/bin/python benchmarks/soak.py                       # 10 minutes
    .venv/bin/python benchmarks/soak.py --duration 120 --out /tmp/soak.md
    .venv/bin/python benchmarks/soak.py --duration 180 --out /tmp/soak-dp.md \
        --topology "--api-server-count 2 --data-parallel-size 2"

Exit status 1 when the run broke an expectation the e2e test asserts
(`tests/e2e/test_soak.py`): any 5xx or timeout, a request not answered as
expected, /health not 200, KV usage not back to 0, the server gone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
from pathlib import Path

from vllm_kvreuse.testing.soak.mix import MALFORMED, WEIGHTS
from vllm_kvreuse.testing.soak.report import Summary, summarize, to_markdown
from vllm_kvreuse.testing.soak.run import SoakConfig, run_soak, start_server

START = "<!-- soak results: start (written by benchmarks/soak.py) -->"
END = "<!-- soak results: end -->"


def write_results(path: Path, markdown: str) -> None:
    """Replaces the results between the markers of ``path`` (appends them
    with the markers if absent)."""
    text = path.read_text() if path.exists() else ""
    block = f"{START}\n\n{markdown}\n{END}"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = f"{text.rstrip()}\n\n{block}\n" if text else f"{block}\n"
    path.write_text(text)


def passed(summary: Summary) -> bool:
    result = summary.result
    return (
        not summary.not_ok
        and summary.health_failures == 0
        and result.drain.emptied
        and result.alive
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=os.environ.get("KVREUSE_MODEL_DIR", "models/tiny")
    )
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--sample-interval", type=float, default=2.0)
    parser.add_argument(
        "--without", nargs="*", default=[], metavar="NAME",
        help=f"kinds ({', '.join(WEIGHTS)}) or malformed bodies "
        f"({', '.join(MALFORMED)}) to leave out of the mix",
    )  # fmt: skip
    parser.add_argument(
        "--topology", default="", metavar="FLAGS",
        help="vllm serve flags added to the soak server's, e.g. "
        "'--api-server-count 2 --data-parallel-size 2'",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("docs/soak.md"))
    parser.add_argument("--log", type=Path, default=None, help="server log path")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    unknown = set(args.without) - set(WEIGHTS) - set(MALFORMED)
    if unknown:
        sys.exit(f"unknown names for --without: {sorted(unknown)}")
    config = SoakConfig(
        duration=args.duration, concurrency=args.concurrency, seed=args.seed,
        request_timeout=args.request_timeout, sample_interval=args.sample_interval,
        weights={k: w for k, w in WEIGHTS.items() if k not in args.without},
        malformed=tuple(name for name in MALFORMED if name not in args.without),
        topology=tuple(shlex.split(args.topology)),
    )  # fmt: skip
    log = args.log or Path(tempfile.mkdtemp()) / "vllm-serve.log"
    print(f"server log: {log}", flush=True)
    with start_server(args.model, log, config.topology) as server:
        result = asyncio.run(run_soak(server, config))
    summary = summarize(result, log)
    command = shlex.join([".venv/bin/python", "benchmarks/soak.py", *sys.argv[1:]])
    markdown = to_markdown(summary, command)
    print(markdown)
    write_results(args.out, markdown)
    print(f"written to {args.out}")
    return 0 if passed(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
