"""`scripts/serve.sh`'s printed examples work exactly as printed.

Starts the script as a new user would (it serves the default model,
SmolLM2-135M-Instruct, with every feature on), reads the examples it prints,
runs them in one shell in order, and checks each answer contains what its
``# expect:`` line says: real answers ("Paris", a RAG answer from the
documents through the chunk cache, by ``chunks`` and by chat messages, a
two-stage call's "Berlin").
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
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
        finally:
            os.killpg(script.pid, signal.SIGTERM)
            script.wait(timeout=60)


def run_and_check(pairs: list[tuple[str, str]]) -> None:
    """Runs every command in one shell (so ``ID=...`` carries over)."""
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
