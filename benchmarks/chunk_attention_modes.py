"""How far chunk-isolated attention is from full attention, per mode.

For RAG-shaped token prompts (system prompt, documents, question) it runs
the model with Hugging Face transformers three ways: full causal attention
(what plain vLLM computes), "isolated" chunks, and "system" chunks (chunks
also see the system prompt), and compares the question's next-token
distributions with full attention's: mean KL(full || mode) over the
question's positions, and top-1 agreement. Lower KL / higher agreement means
the mode changes the model's answer less.

    .venv/bin/python benchmarks/chunk_attention_modes.py [--model models/small]

On a random-weight model this measures deviation, not answer quality.
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import AutoModelForCausalLM

from vllm_kvreuse.testing.reference import chunk_attention_mask


@torch.no_grad()
def question_logprobs(model, ids: list[int], attention) -> torch.Tensor:
    total = len(ids)
    logits = model(
        input_ids=torch.tensor([ids]),
        attention_mask=attention,
        position_ids=torch.arange(total)[None],
    ).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=200)
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    vocab = model.config.vocab_size
    rng = random.Random(0)
    results: dict[str, list[tuple[float, float]]] = {"isolated": [], "system": []}
    for _ in range(args.prompts):
        segments = [
            [rng.randrange(50, vocab) for _ in range(n)]
            for n in (48, args.doc_tokens, args.doc_tokens, args.doc_tokens, 16)
        ]
        ids = [t for s in segments for t in s]
        lengths = [len(s) for s in segments[:-1]]
        question = slice(sum(lengths), len(ids))
        full = question_logprobs(model, ids, None)[question]
        for mode, see_system in (("isolated", False), ("system", True)):
            got = question_logprobs(
                model, ids, chunk_attention_mask(lengths, len(ids), see_system)
            )[question]
            kl = torch.sum(full.exp() * (full - got), dim=-1).mean().item()
            agree = (full.argmax(-1) == got.argmax(-1)).float().mean().item()
            results[mode].append((kl, agree))
    print(
        f"model {args.model}, {args.prompts} prompts, 3 documents of "
        f"{args.doc_tokens} tokens, 48-token system prompt, 16-token question"
    )
    print("| mode | mean KL(full ‖ mode) | top-1 agreement with full attention |")
    print("|---|---|---|")
    for mode, rows in results.items():
        kl = sum(r[0] for r in rows) / len(rows)
        agree = sum(r[1] for r in rows) / len(rows)
        print(f"| {mode} | {kl:.4f} | {agree:.1%} |")


if __name__ == "__main__":
    main()
