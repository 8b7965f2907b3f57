"""The Triton paged-decode kernel against the torch implementation.

On CPU-only machines the kernel runs under ``TRITON_INTERPRET=1`` in a subprocess (the interpreter
must be chosen before the kernel is built, and this keeps the rest of the session on compiled
kernels); on a GPU it runs natively, and the engine's CUDA path is checked end to end.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from instance_agent.engine.attention import decode_attention_torch


def _require_triton() -> None:
    # Checked without importing: the kernels run in a subprocess, and importing triton here makes its
    # bindings report spurious leaks when pytest exits.
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")


CASES = [  # (block_size, heads, kv_heads, head_dim, context lens)
    (4, 4, 2, 16, [1, 5, 16, 17, 23]),
    (16, 8, 2, 24, [3, 40, 16]),  # head_dim not a power of two, 4 query heads per KV head
    (8, 2, 2, 8, [9, 1]),  # no grouping
]


def compare(device: str, dtype: torch.dtype) -> float:
    """Largest |triton - torch| over CASES (random caches, shuffled padded block tables)."""
    from instance_agent.engine.triton_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for block_size, heads, kv_heads, head_dim, lens in CASES:
        max_blocks = -(-max(lens) // block_size) + 1  # one padding column
        num_blocks = len(lens) * max_blocks + 3
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
        query = torch.randn(len(lens), heads, head_dim, generator=gen)
        table = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks]
        table = table.view(len(lens), max_blocks)
        context = torch.tensor(lens, dtype=torch.int32)
        mask = (torch.arange(max_blocks * block_size)[None, :] < context[:, None])[:, None, None]
        scale = head_dim**-0.5
        expected = decode_attention_torch(query, cache, table, mask, scale)
        got = paged_decode_attention(
            query.to(device, dtype),
            cache.to(device, dtype),
            table.to(device),
            context.to(device),
            scale,
        )
        worst = max(worst, (got.float().cpu() - expected).abs().max().item())
    return worst


@pytest.mark.slow
def test_triton_kernel_matches_torch_under_interpreter() -> None:
    _require_triton()
    code = (
        "import importlib.util, sys, torch; "
        "spec = importlib.util.spec_from_file_location('triton_case', sys.argv[1]); "
        "t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t); "
        "print(t.compare('cpu', torch.float32))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", code, __file__], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.strip().splitlines()[-1]) < 1e-5


def engine_greedy(device: str, use_triton: bool) -> list[list[int]]:
    """Greedy outputs of the tiny engine on mixed-length prompts, decodes on the chosen path."""
    from instance_agent.engine.core.request import SamplingParams
    from instance_agent.engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", device=device, dtype="float32", block_size=4))
    engine.runner.use_triton = use_triton
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(40, 90)), [7]]
    return [o.output_token_ids for o in engine.generate(prompts, params)]


@pytest.mark.slow
def test_engine_triton_decode_path_under_interpreter() -> None:
    _require_triton()
    code = (
        "import importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('triton_case', sys.argv[1]); "
        "t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t); "
        "assert t.engine_greedy('cpu', True) == t.engine_greedy('cpu', False)"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", code, __file__], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernel_matches_torch_on_gpu() -> None:
    assert compare("cuda", torch.float32) < 1e-4
    assert compare("cuda", torch.bfloat16) < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_gpu_matches_cpu_greedy() -> None:
    assert engine_greedy("cuda", True) == engine_greedy("cpu", False)
