"""The final beams' text: vLLM's decode against ours, paired, in one run.

``LLM.beam_search`` returns each final beam's text: the decode of its
prompt and tokens. vLLM's loop calls ``tokenizer.decode`` on each beam's
token list; the engine's beams come back through
:func:`vllm_kvreuse.beam.answers.offline_beam_output`, which decodes an
integer array built on the prompt's (the same text: a transformers
tokenizer checks a list item by item in Python before decoding). Times
``--searches`` searches of width ``--width``, ``--max-tokens`` tokens each
on ``--prompt-tokens``-token prompts, both ways in turn, and prints the
medians and the paired ratio (ours / vLLM's, which also builds the
sequences).

    .venv/bin/python benchmarks/beam_text_micro.py                      # 16 x 50
    .venv/bin/python benchmarks/beam_text_micro.py --searches 1 --width 512
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from vllm.sampling_params import BeamSearchParams
from vllm.tokenizers import get_tokenizer

from vllm_kvreuse.beam.answers import offline_beam_output
from vllm_kvreuse.testing.beam_outputs import root_output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny", help="its tokenizer")
    parser.add_argument("--searches", type=int, default=16)
    parser.add_argument("--width", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    tokenizer = get_tokenizer(args.model)
    rng = random.Random(0)
    vocab = len(tokenizer)
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens)
    searches = []
    for _ in range(args.searches):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        beams = [
            [rng.randrange(vocab) for _ in range(args.max_tokens)]
            for _ in range(args.width)
        ]
        searches.append((prompt, beams, root_output(prompt, beams)))

    def vllms() -> list[str]:
        return [
            tokenizer.decode(prompt + beam, skip_special_tokens=True)
            for prompt, beams, _ in searches
            for beam in beams
        ]

    def ours() -> list[str]:
        return [
            seq.text
            for _, _, final in searches
            for seq in offline_beam_output(final, {}, params, tokenizer).sequences
        ]

    assert vllms() == ours(), "the texts differ"
    theirs_ms, ours_ms = [], []
    for _ in range(args.repeats):
        for run, times in ((vllms, theirs_ms), (ours, ours_ms)):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
    ratios = sorted(b / a for a, b in zip(theirs_ms, ours_ms, strict=True))
    print(
        f"{args.searches} x {args.width} beams, "
        f"{args.prompt_tokens + args.max_tokens} tokens each ({args.model}): "
        f"vLLM's decode {statistics.median(theirs_ms):.1f} ms, "
        f"ours {statistics.median(ours_ms):.1f} ms; ours / vLLM's "
        f"{statistics.median(ratios):.2f} (paired, {ratios[0]:.2f}-{ratios[-1]:.2f} "
        f"over {len(ratios)})"
    )


if __name__ == "__main__":
    main()
