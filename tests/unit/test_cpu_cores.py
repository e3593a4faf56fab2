"""CPU core binding with the chunk-cache connector is plain vLLM's.

vLLM's ``OMPProcessManager`` reserves one more core per worker for any KV
connector; the registered patch (:mod:`vllm_kvreuse.device.cpu_cores`)
undoes that for the chunk cache's connector only.
"""

from __future__ import annotations

import pytest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.utils.ompmultiprocessing import OMPProcessManager

from vllm_kvreuse.chunk_cache.engine_args import (
    CHUNK_CONNECTOR,
    CHUNK_CONNECTOR_MODULE,
    beside_chunk_connector,
)
from vllm_kvreuse.device.cpu_cores import WithoutKVConnector, is_plugin_connector

CHUNK = KVTransferConfig(
    kv_connector=CHUNK_CONNECTOR,
    kv_connector_module_path=CHUNK_CONNECTOR_MODULE,
    kv_role="kv_both",
)
OTHER = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")


def binding(config: VllmConfig) -> tuple[int, list[list[int]], list[int]]:
    manager = OMPProcessManager(config)
    return manager.reserve_cpu_num, manager.cpu_lists, manager.reserved_cpu_list


@pytest.fixture(autouse=True)
def no_user_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")


def test_chunk_connector_binds_cores_as_plain_vllm() -> None:
    plain = binding(VllmConfig())
    assert binding(VllmConfig(kv_transfer_config=CHUNK)) == plain


def test_other_connectors_keep_vllms_extra_reservation() -> None:
    plain_reserved = binding(VllmConfig())[0]
    other = VllmConfig(kv_transfer_config=OTHER)
    assert binding(other)[0] == plain_reserved + other.parallel_config.local_world_size


def test_chunk_cache_beside_another_connector_keeps_vllms_reservation() -> None:
    """In a MultiConnector the other connector may run transfer threads."""
    plain_reserved = binding(VllmConfig())[0]
    multi = VllmConfig(kv_transfer_config=beside_chunk_connector(OTHER))
    assert not is_plugin_connector(multi.kv_transfer_config)
    assert binding(multi)[0] == plain_reserved + multi.parallel_config.local_world_size


def test_user_reservation_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert binding(VllmConfig(kv_transfer_config=CHUNK))[0] == 0


def test_view_hides_only_the_connector() -> None:
    config = VllmConfig(kv_transfer_config=CHUNK)
    view = WithoutKVConnector(config)
    assert is_plugin_connector(config.kv_transfer_config)
    assert not is_plugin_connector(OTHER)
    assert view.kv_transfer_config is None
    assert view.parallel_config is config.parallel_config
    with pytest.raises(AttributeError):
        view.kv_transfer_config = CHUNK  # type: ignore[misc]


def test_only_the_plugins_own_module_paths_count() -> None:
    """A user's connector named by module path keeps vLLM's reservation,
    even one whose package name starts like the plugin's."""
    for path in ("my_connectors.fast", "vllm_kvreuse_extra.connector"):
        user = KVTransferConfig(
            kv_connector="Mine", kv_connector_module_path=path, kv_role="kv_both"
        )
        assert not is_plugin_connector(user), path
