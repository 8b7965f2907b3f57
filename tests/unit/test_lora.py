"""LoRA adapters in kvherd's engine (CPU, fp32).

Parity with HF transformers + `peft` (the adapter applied unmerged) on the tiny random Llama:
greedy outputs with one adapter, and a mixed step (the base model and two adapters batched
together) giving every request exactly its solo output. Prefix caching keeps adapters apart
(hashes as the proxy computes them); migration state carries the adapter and a destination
without it refuses; a bad adapter is a clear error at start.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import write_adapter

from instance_agent import agent_cli
from instance_agent.engine.config import PRESETS
from instance_agent.engine.core.request import InvalidRequestError, SamplingParams
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import BlockStored

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], str | None]]) -> dict[str, Any]:
    """Add every request at once, step to the end; {id: final output}. The first step must
    schedule them all (one mixed batch)."""
    for rid, ids, lora in requests:
        engine.add_request(rid, ids, GREEDY, lora_name=lora)
    final = {out.request_id: out for out in engine.step() if out.finished}
    assert all(engine.scheduler.requests[rid].num_computed_tokens for rid, *_ in requests)
    while engine.has_unfinished():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    engine.block_manager.check_integrity()
    return final


# -- parity with HF peft --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def peft_adapters(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    peft = pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    base = hf_checkpoints["llama"]
    root = tmp_path_factory.mktemp("peft_adapters")
    specs: dict[str, dict[str, Any]] = {
        "A": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
        "B": {
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj", "down_proj"],
            "use_rslora": True,
        },
    }
    paths = {}
    for i, (name, kwargs) in enumerate(specs.items()):
        torch.manual_seed(100 + i)
        model = LlamaForCausalLM.from_pretrained(base)
        config = peft.LoraConfig(init_lora_weights=False, **kwargs)
        peft.get_peft_model(model, config).save_pretrained(root / name)
        paths[name] = root / name
    return base, paths


def _hf_greedy(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model: Any = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)  # unmerged: y += B(A(x)) * scaling
    with torch.no_grad():
        out = model.eval().generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=GREEDY.max_tokens,
            min_new_tokens=GREEDY.max_tokens,
            pad_token_id=0,
        )
    return list(out[0, len(prompt) :].tolist())


def test_greedy_parity_with_peft_single_and_mixed_batch(peft_adapters) -> None:
    base, paths = peft_adapters
    modules = {name: str(path) for name, path in paths.items()}

    def engine() -> LLMEngine:
        config = EngineConfig(model=str(base), block_size=4, device="cpu", lora_modules=modules)
        return LLMEngine(config)

    cases = [("base", _prompt(9, 1), None), ("a", _prompt(21, 2), "A"), ("b", _prompt(14, 3), "B")]
    reference = {
        rid: _hf_greedy(base, paths[lora] if lora else None, ids) for rid, ids, lora in cases
    }
    assert len({tuple(r) for r in reference.values()}) == 3
    solo = {}
    for case in cases:
        solo.update(_run(engine(), [case]))
    mixed = _run(engine(), cases)  # the base model and both adapters in every step
    # The same prompt under each adapter too: every adapter changes the output.
    same = _run(engine(), [(f"same-{lora}", cases[1][1], lora) for lora in (None, "A", "B")])
    for rid, _, _ in cases:
        assert solo[rid].output_token_ids == reference[rid], rid
        assert mixed[rid].output_token_ids == reference[rid], rid
    assert len({tuple(out.output_token_ids) for out in same.values()}) == 3


# -- prefix caching, migration state, refusals (the tiny preset, adapters written here) -----------
@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_adapters")
    config = PRESETS["tiny"]
    return {
        "A": str(write_adapter(root / "A", config, seed=1)),
        "B": str(write_adapter(root / "B", config, rank=2, targets=["q_proj", "o_proj"], seed=2)),
    }


def _tiny(adapters: dict[str, str], **overrides: Any) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model="tiny", device="cpu", block_size=4, lora_modules=adapters, **overrides)
    )


def test_prefix_cache_keeps_adapters_apart(tiny_adapters: dict[str, str]) -> None:
    engine = _tiny(tiny_adapters)
    ids = _prompt(40, 7)
    cached = {}
    for rid, lora in (("a1", "A"), ("b1", "B"), ("base", None), ("a2", "A")):
        engine.add_request(rid, ids, GREEDY, lora_name=lora)
        request = engine.scheduler.requests[rid]
        # Exactly the proxy's hashes (`routed_request`): the adapter's name in every block.
        assert request.block_hashes == block_hash_chain(ids, 4, lora_name=lora)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    cached[rid] = out.num_cached_tokens
        if lora is not None:  # grown by decodes: still hashed with the adapter
            assert request.block_hashes == block_hash_chain(request.token_ids, 4, lora_name=lora)
    assert cached == {"a1": 0, "b1": 0, "base": 0, "a2": 36}
    stores = [e for e in engine.take_kv_event_batch().events if isinstance(e, BlockStored)]
    assert {e.lora_name for e in stores} == {"A", "B", None}


def test_migration_state_carries_the_adapter(tiny_adapters: dict[str, str]) -> None:
    source, with_it, without = _tiny(tiny_adapters), _tiny(tiny_adapters), _tiny({})
    ids = _prompt(30, 4)
    (expected,) = _run(_tiny(tiny_adapters), [("r", ids, "B")]).values()
    source.add_request("r", ids, GREEDY, lora_name="B")
    for _ in range(4):
        source.step()
    state = source.export_request_state("r")
    assert state["lora_name"] == "B"
    blocks, _ = source.request_blocks("r")
    kv = source.read_kv(blocks)
    for dst in (without, with_it):
        reserved = dst.reserve_blocks("mig", len(blocks))
        assert reserved is not None
        dst.write_kv(reserved, kv)
        if dst is without:
            with pytest.raises(ValueError, match="does not serve the request's LoRA adapter 'B'"):
                dst.adopt_request(state, reserved, "mig")
            dst.free_reservation("mig")
            assert dst.block_manager.owners() == []
            continue
        dst.adopt_request(state, reserved, "mig")
        outputs = []
        while dst.has_unfinished():
            outputs += [out for out in dst.step() if out.finished]
        assert outputs[0].output_token_ids == expected.output_token_ids


def test_continuation_keeps_the_adapter(tiny_adapters: dict[str, str]) -> None:
    ids = _prompt(18, 5)
    (full,) = _run(_tiny(tiny_adapters), [("r", ids, "A")]).values()
    engine = _tiny(tiny_adapters)
    head = full.output_token_ids[:5]
    engine.continue_request(
        "r", ids, head, GREEDY, sampling_seed=None, emitted_text="", lora_name="A"
    )
    while engine.has_unfinished():
        outputs = [out for out in engine.step() if out.finished]
    assert outputs[0].output_token_ids == full.output_token_ids


def test_unknown_adapter_is_refused_before_any_block(tiny_adapters: dict[str, str]) -> None:
    engine = _tiny(tiny_adapters)
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'C'"):
        engine.add_request("r", [1, 2, 3], GREEDY, lora_name="C")
    assert engine.block_manager.owners() == [] and not engine.has_unfinished()


def _edit(path: Path, **changes: Any) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))


BAD_ADAPTERS: dict[str, tuple[Any, str]] = {
    "unsupported target": ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    "dora": ({"use_dora": True}, "use_dora=True is not supported"),
    "bias": ({"bias": "all"}, "bias='all' is not supported"),
    "rank": ({"r": 8}, r"has shape \(4, 64\), expected \(8, 64\)"),
    "missing tensor": ({"target_modules": ["q_proj", "k_proj", "gate_proj"]}, "missing tensor"),
    "extra tensor": ({"target_modules": ["q_proj"]}, "unexpected tensor"),
    "alpha": ({"lora_alpha": 0}, "lora_alpha must be a positive number"),
    "not lora": ({"peft_type": "IA3"}, "is not LORA"),
    "no match": ({"target_modules": r".*\.lm_head"}, "matches no projection"),
}


@pytest.mark.parametrize("case", BAD_ADAPTERS, ids=list(BAD_ADAPTERS))
def test_a_bad_adapter_is_a_clear_error(tmp_path: Path, case: str) -> None:
    changes, message = BAD_ADAPTERS[case]
    path = write_adapter(tmp_path / "bad", PRESETS["tiny"], targets=["q_proj", "k_proj"])
    _edit(path, **changes)
    with pytest.raises(ValueError, match=message):
        _tiny({"bad": str(path)})


def test_regex_targets_and_slots(tmp_path: Path, tiny_adapters: dict[str, str]) -> None:
    path = write_adapter(tmp_path / "re", PRESETS["tiny"], targets=["v_proj", "o_proj"])
    _edit(path, target_modules=r".*\.(v_proj|o_proj)")
    assert _tiny({"re": str(path)}).lora_adapters["re"].rank == 4
    with pytest.raises(ValueError, match="max_loras 1 leaves no slot"):
        _tiny(tiny_adapters, max_loras=1)


def test_agent_refuses_to_start_with_a_bad_adapter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    parser = argparse.ArgumentParser()
    agent_cli.add_arguments(parser)
    with pytest.raises(ValueError, match="expected NAME=DIR"):
        agent_cli.parse_lora_modules(["nodir"], "tiny")
    with pytest.raises(ValueError, match="already served"):
        agent_cli.parse_lora_modules(["A=x", "A=y"], "tiny")
    args = parser.parse_args(["--lora-modules", f"X={tmp_path / 'absent'}", "--device", "cpu"])
    with caplog.at_level(logging.ERROR):
        assert agent_cli.run(args) == 2
    assert "LoRA adapter 'X'" in caplog.text and "is not a directory" in caplog.text
