"""Engine-core CPU per request: a continuation child vs a plain prefix hit.

Issue: a child must cost no more CPU than a plain request with a prefix hit.
This times the engine-side work only (no model run), on a real vLLM
scheduler with the plugin's hook layer, for requests whose prompt repeats a
finished request's ``--prompt-tokens`` tokens plus a short suffix:

- ``plain``: a token-id request; the finished request's blocks are found by
  the prefix cache (the partial last block is recomputed);
- ``child``: the same tokens naming a retained parent (``kvreuse_parent``);
  it inherits the parent's blocks, the partial tail copy-on-write.

Each sample builds the request (block hashes included), adds it, runs one
schedule and one update (a fake one-token model output), and frees it.

    .venv/bin/python benchmarks/continuation_cpu.py --prompt-tokens 1400
"""

from __future__ import annotations

import argparse
import statistics
import time

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import vllm_kvreuse
from vllm_kvreuse.config import ADDITIONAL_CONFIG_KEY
from vllm_kvreuse.request_args import PARENT

BLOCK = 32


def make_scheduler(model: str, num_blocks: int):
    model_config = ModelConfig(model=model, dtype="float32", skip_tokenizer_init=True)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig.default_factory(
            max_num_seqs=16, max_num_batched_tokens=8192, max_model_len=8192,
            async_scheduling=False,
        ),
        additional_config={
            ADDITIONAL_CONFIG_KEY: {
                "enable_continuation": True, "retain_kv_max_fraction": 0.5
            }
        },
    )  # fmt: skip
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=32, dtype="float32")
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )  # fmt: skip
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return cls(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK, log_stats=True,
    )  # fmt: skip


HASHER = None


def request(request_id: str, prompt: list[int], **extra) -> Request:
    params = SamplingParams(max_tokens=1, extra_args=extra or None)
    return Request(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
        pooling_params=None, block_hasher=HASHER,
    )  # fmt: skip


def step(scheduler) -> None:
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
        ),
    )  # fmt: skip


def sample(scheduler, request_id: str, prompt: list[int], **extra) -> float:
    start = time.perf_counter()
    scheduler.add_request(request(request_id, prompt, **extra))
    step(scheduler)  # prefill to its one token: finished and freed
    return time.perf_counter() - start


def main() -> None:
    global HASHER
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--prompt-tokens", type=int, default=1400)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    vllm_kvreuse.register()  # the patches, as vLLM's plugin loader would
    init_none_hash(sha256)
    HASHER = get_request_block_hasher(BLOCK, sha256)
    scheduler = make_scheduler(args.model, num_blocks=4 * args.prompt_tokens // BLOCK)
    parent_prompt = list(range(100, 100 + args.prompt_tokens))
    parent = request("parent", parent_prompt, retain_kv=True, retain_kv_ttl=3600.0)
    parent.sampling_params.max_tokens = 2
    scheduler.add_request(parent)
    for _ in range(3):
        step(scheduler)
    held = scheduler.kvreuse.ledger.get("parent")
    assert held is not None, "the parent was not retained"
    base = [*held.token_ids, 7]
    times: dict[str, list[float]] = {"plain": [], "child": []}
    for i in range(args.samples):
        suffix = [11, 12, 13 + i % 50]
        times["plain"].append(sample(scheduler, f"p{i}", base + suffix))
        times["child"].append(
            sample(scheduler, f"c{i}", base + suffix, **{PARENT: "parent"})
        )
    plain, child = (statistics.median(times[k]) * 1e6 for k in ("plain", "child"))
    print(f"prompt {len(base) + 3} tokens, {args.samples} samples each, median:")
    print(f"| plain prefix hit | {plain:.0f} us |")
    print(f"| continuation child | {child:.0f} us |")
    print(f"| child / plain | {child / plain:.2f} |")


if __name__ == "__main__":
    main()
