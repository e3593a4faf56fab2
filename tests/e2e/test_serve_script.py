"""`scripts/serve.sh`'s printed examples work exactly as printed.

Starts the script as a new user would (it serves the default model,
SmolLM2-135M-Instruct, with every feature on), reads the examples it prints,
runs them in one shell in order, and checks each answer contains what its
``# expect:`` line says: real answers ("Paris", a RAG answer from the
documents through the chunk cache, by ``chunks`` and by chat messages, a
two-stage call's "Berlin"). Then, on the same server, every example the
feature pages mark ``<!-- runs -->`` (tests/unit/test_docs.py finds them),
as printed but for the server's address and the model's name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.unit.test_docs import runnable_examples
from vllm_kvreuse.testing.server import OWN_PROCESS_GROUP, free_port, server_env

pytestmark = [
    pytest.mark.e2e,
    # It serves the 30-layer default model; through the interpreted V2
    # runner that alone would cost most of CI's V2 budget. The V2 tier runs
    # every endpoint and feature of these examples on the tiny model.
    pytest.mark.v1_only("CI time: serves the 135M default model"),
]

START = "says that the answer contains X.\n"
END = "Press Ctrl-C to stop."


def examples(printed: str) -> list[tuple[str, str]]:
    """(command, expected substring) pairs, in printed order; a command is its
    lines up to the one without a trailing backslash."""
    body = printed.split(START, 1)[1].split(END, 1)[0].splitlines()
    pairs: list[tuple[str, str]] = []
    command: list[str] = []
    for line in body:
        if line.startswith("# expect:"):
            pairs.append((pairs.pop()[0], line.removeprefix("# expect:").strip()))
        elif command or (line and not line.startswith("#")):
            command.append(line)
            if not line.endswith("\\"):
                pairs.append(("\n".join(command), ""))
                command = []
    return pairs


def test_every_printed_example_works(smollm2_dir: str, tmp_path: Path) -> None:
    port = free_port()
    env = {**server_env(), "PORT": str(port), "KVREUSE_MODEL_DIR": smollm2_dir}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        script = subprocess.Popen(
            ["bash", "scripts/serve.sh"], cwd=ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT, **OWN_PROCESS_GROUP,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while END not in log.read_text(errors="replace"):
                assert script.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "serve.sh printed no examples"
                time.sleep(1)
            pairs = examples(log.read_text())
            assert sum(1 for _, expect in pairs if expect) >= 8, pairs
            run_and_check(pairs)
            run_doc_examples(f"127.0.0.1:{port}", Path(smollm2_dir).name)
        finally:
            os.killpg(script.pid, signal.SIGTERM)
            script.wait(timeout=60)


def run_and_check(pairs: list[tuple[str, str]]) -> list[str]:
    """Runs every command in one shell (so ``ID=...`` carries over); returns
    each command's output."""
    marker = "@@example"
    script = "\n".join(
        f"echo {marker}{i}\n{cmd}\necho" for i, (cmd, _) in enumerate(pairs)
    )
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    outputs = done.stdout.split(marker)[1:]
    assert len(outputs) == len(pairs)
    for (command, expect), output in zip(pairs, outputs, strict=True):
        assert expect in output.replace(" ", ""), f"{command}\n->{output}"
    return outputs


def split_at_expects(code: str) -> list[tuple[str, str]]:
    """(code, expected substring) pairs of a block: each ``# expect: X``
    line closes the code above it."""
    pairs: list[tuple[str, str]] = []
    lines: list[str] = []
    for line in code.splitlines():
        if line.startswith("# expect:"):
            pairs.append(("\n".join(lines), line.removeprefix("# expect:").strip()))
            lines = []
        else:
            lines.append(line)
    if any(line.strip() for line in lines):
        pairs.append(("\n".join(lines), ""))
    return pairs


def run_doc_examples(address: str, model: str) -> None:
    """The docs' runnable examples against this server: shell blocks in one
    shell, in page order; python blocks each in a fresh interpreter. None
    may answer with an error object."""
    shell: list[tuple[str, str]] = []
    for page, lang, code in runnable_examples():
        code = code.replace("localhost:8000", address)
        code = code.replace('"smollm2"', f'"{model}"')
        if lang == "bash":
            shell += split_at_expects(code)
            continue
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"{page}\n{code}\n{done.stderr[-3000:]}"
        for _, expect in split_at_expects(code):
            assert expect in done.stdout, f"{page}\n{code}\n->{done.stdout}"
    for (command, _), output in zip(shell, run_and_check(shell), strict=True):
        assert '"object":"error"' not in output.replace(" ", ""), (
            f"{command}\n->{output}"
        )
