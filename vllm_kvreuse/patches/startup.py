"""Patches that put the plugin's settings into vLLM and pick the scheduler."""

from __future__ import annotations

from vllm_kvreuse.patches.registry import V0_32_0, Patch

_ARGS = "vllm.engine.arg_utils"

PATCHES: tuple[Patch, ...] = (
    Patch(
        target="vllm.entrypoints.serve.utils.api_utils:redact_sensitive_args",
        wrapper="vllm_kvreuse.chunk_cache.tiers.urls:wrap_redact_sensitive_args",
        kind="function",
        signatures={V0_32_0: "(args: dict[str, typing.Any]) -> dict[str, typing.Any]"},
        why="`vllm serve` logs its non-default arguments, hiding only vLLM's "
        "own secrets: a password in --chunk-cache-remote-url would stand in "
        "the log.",
        how="Calls the original, then shows the store URL with its password as ***.",
        remove_when="vLLM lets plugins name their sensitive arguments.",
    ),
    Patch(
        target=f"{_ARGS}:EngineArgs.add_cli_args",
        wrapper="vllm_kvreuse.engine_args:wrap_add_cli_args",
        kind="staticmethod",
        signatures={
            V0_32_0: "(parser: vllm.utils.argparse_utils.FlexibleArgumentParser) "
            "-> vllm.utils.argparse_utils.FlexibleArgumentParser"
        },
        why="`vllm serve --help` must list the plugin's flags; general plugins "
        "have no hook to add CLI arguments.",
        how="Calls the original, then adds a 'vllm-kvreuse' argument group.",
        remove_when="vLLM gains a plugin hook for engine CLI arguments.",
    ),
    Patch(
        target=f"{_ARGS}:EngineArgs.from_cli_args",
        wrapper="vllm_kvreuse.engine_args:wrap_from_cli_args",
        kind="classmethod",
        signatures={V0_32_0: "(cls, args: argparse.Namespace)"},
        why="EngineArgs only copies its own dataclass fields from the parsed "
        "namespace, so the plugin's flags would be dropped.",
        how="Calls the original, then folds the plugin's flags into "
        "additional_config['kvreuse'], which reaches every process.",
        remove_when="Same as add_cli_args.",
    ),
    Patch(
        target=f"{_ARGS}:EngineArgs.__init__",
        wrapper="vllm_kvreuse.engine_args:wrap_engine_args_init",
        kind="function",
        signatures={V0_32_0: "sha256:b04e5258010a7129"},
        why="LLM(...) passes unknown keyword arguments to EngineArgs, a "
        "dataclass that refuses them.",
        how="Pops the plugin's settings from the keyword arguments and folds "
        "them into additional_config before calling the original.",
        remove_when="Same as add_cli_args.",
    ),
    Patch(
        target=f"{_ARGS}:AsyncEngineArgs.__init__",
        wrapper="vllm_kvreuse.engine_args:wrap_engine_args_init",
        kind="function",
        signatures={V0_32_0: "sha256:65d303dd4cfbf265"},
        why="AsyncEngineArgs is a dataclass of its own with its own __init__.",
        how="As EngineArgs.__init__.",
        remove_when="Same as add_cli_args.",
    ),
    Patch(
        target="vllm.config.scheduler:SchedulerConfig.get_scheduler_cls",
        wrapper="vllm_kvreuse.scheduler:wrap_get_scheduler_cls",
        kind="function",
        signatures={V0_32_0: "(self) -> type['SchedulerInterface']"},
        why="Setting scheduler_cls to one class would lose vLLM's choice "
        "between Scheduler and AsyncScheduler (and any user or platform "
        "scheduler).",
        how="Calls the original; when a feature is on, returns a subclass with "
        "the plugin's hook layer in front of whatever class vLLM chose, else "
        "vLLM's class untouched.",
        remove_when="scheduler_cls accepts mixins, or a scheduler plugin hook.",
    ),
    Patch(
        target="vllm.config.vllm:VllmConfig.__post_init__",
        wrapper="vllm_kvreuse.engine_args:wrap_vllm_config_post_init",
        kind="function",
        signatures={V0_32_0: "(self)"},
        why="get_scheduler_cls sees only the scheduler config, not "
        "additional_config, yet must know whether a feature is on.",
        how="Calls the original, validates additional_config['kvreuse'] (a "
        "bad setting fails start-up), and records the features switched on "
        "as an attribute of the scheduler config.",
        remove_when="Same as get_scheduler_cls.",
    ),
)


SCHEDULER_OVERRIDES: dict[str, dict[str, str]] = {
    "__init__": {V0_32_0: "sha256:f3bbb3041173f9db"},
    "add_request": {V0_32_0: "(self, request: vllm.v1.request.Request) -> None"},
    "finish_requests": {
        V0_32_0: "(self, request_ids: str | collections.abc.Iterable[str] | "
        "None, finished_status: vllm.v1.request.RequestStatus) -> "
        "list[vllm.v1.request.Request]"
    },
    "_free_request": {
        V0_32_0: "(self, request: vllm.v1.request.Request, delay_free_blocks: "
        "bool = False) -> tuple[dict[str, typing.Any] | None, dict[str, typing.Any] "
        "| None]"
    },
    "_free_blocks": {V0_32_0: "(self, request: vllm.v1.request.Request)"},
    "_preempt_request": {
        V0_32_0: "(self, request: vllm.v1.request.Request, timestamp: "
        "float, drop_stale_output: bool = False) -> None"
    },
    "_get_local_prefix_cache_hit": {
        V0_32_0: "(self, request: vllm.v1.request.Request) -> "
        "tuple[vllm.v1.core.kv_cache_manager.KVCacheBlocks, int, int, bool]"
    },
    "schedule": {
        V0_32_0: "(self, throttle_prefills: bool = False) -> "
        "vllm.v1.core.sched.output.SchedulerOutput"
    },
    "update_from_output": {
        V0_32_0: "(self, scheduler_output: vllm.v1.core.sched.output."
        "SchedulerOutput, model_runner_output: vllm.v1.outputs.ModelRunnerOutput) -> "
        "dict[int, vllm.v1.engine.EngineCoreOutputs]"
    },
    "has_requests": {V0_32_0: "(self) -> bool"},
    "_reserve_prefill_lookahead": {
        V0_32_0: "(self, request: vllm.v1.request.Request, num_computed_tokens: "
        "int, num_new_tokens: int) -> int"
    },
    "reset_prefix_cache": {
        V0_32_0: "(self, reset_running_requests: bool = False, "
        "reset_connector: bool = False) -> bool"
    },
}
"""Upstream ``Scheduler`` methods the hook layer
(:class:`vllm_kvreuse.core.layer.KVReuseLayer`) overrides, each once, with
their signatures per supported vLLM release. Not patches (the layer is a subclass that
calls ``super()``), but as tied to upstream: several are private, and
``tests/unit/test_hook_layer.py`` fails when one changes."""
