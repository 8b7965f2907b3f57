"""End-to-end engine behaviour on the tiny random model (CPU, fp32).

Prefix caching, preemption, batching, seeded sampling and migration must never change a request's
tokens; stop strings cut text the way OpenAI does; bad input is refused before any KV block moves.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from instance_agent.engine.core.request import InvalidRequestError, SamplingParams
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from instance_agent.engine.sampler import SamplingRow, draw_seed, sample
from kvherd.kv_events import BlockStored


def make_engine(**overrides: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", device="cpu", **overrides))  # type: ignore[arg-type]


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run(
    engine: LLMEngine,
    requests: Sequence[tuple[str, list[int], SamplingParams]],
    stagger: int = 0,
) -> dict[str, RequestOutput]:
    """Add requests (one every `stagger` steps), step to the end, check block accounting each step."""
    pending = list(requests)
    final: dict[str, RequestOutput] = {}
    steps = 0
    while pending or engine.has_unfinished():
        if pending and (stagger == 0 or steps % stagger == 0):
            for rid, ids, params in pending if stagger == 0 else pending[:1]:
                engine.add_request(rid, ids, params)
            pending = [] if stagger == 0 else pending[1:]
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.block_manager.check_integrity()
        steps += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return final


def test_prefix_cache_parity_and_fewer_computed_tokens() -> None:
    shared = prompt(48, seed=1)  # three full blocks of 16
    first, second = shared + prompt(5, seed=2), shared + prompt(7, seed=3)
    computed = {}
    outputs = {}
    for caching in (False, True):
        engine = make_engine(enable_prefix_caching=caching)
        engine.generate([first], GREEDY)
        before = engine.num_computed_tokens_total
        (out,) = engine.generate([second], GREEDY)
        computed[caching] = engine.num_computed_tokens_total - before
        outputs[caching] = out
    assert outputs[True].output_token_ids == outputs[False].output_token_ids
    assert outputs[True].num_cached_tokens == 48 and outputs[False].num_cached_tokens == 0
    # Prompt tokens past the hit, then one decode per output token after the first.
    assert computed[False] == len(second) + GREEDY.max_tokens - 1
    assert computed[True] == len(second) - 48 + GREEDY.max_tokens - 1


def _mixed_requests() -> list[tuple[str, list[int], SamplingParams]]:
    reqs = []
    for i, n in enumerate((20, 9, 31, 14, 25, 6)):
        params = (
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
            if i % 2 == 0
            else SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True)
        )
        reqs.append((f"r{i}", prompt(n, seed=10 + i), params))
    return reqs


def test_preemption_parity() -> None:
    reqs = _mixed_requests()
    free = run(make_engine(block_size=4), reqs)
    tight_engine = make_engine(block_size=4, num_gpu_blocks=24)
    tight = run(tight_engine, reqs)
    assert tight_engine.scheduler.num_preemptions > 0
    for rid, _, _ in reqs:
        assert tight[rid].output_token_ids == free[rid].output_token_ids, rid
        assert tight[rid].text == free[rid].text


def test_greedy_batch_invariance() -> None:
    target = ("target", prompt(37, seed=5), GREEDY)
    alone = run(make_engine(), [target])["target"]
    others = [
        (f"o{i}", prompt(n, seed=20 + i), GREEDY) for i, n in enumerate((3, 150, 12, 61, 200))
    ]
    # The target is already decoding when long prefills and short requests join its batch.
    batched = run(make_engine(max_num_batched_tokens=64), [target, *others], stagger=2)
    assert batched["target"].output_token_ids == alone.output_token_ids


def test_seeded_sampling_deterministic_and_batch_invariant() -> None:
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, top_k=50, seed=123)
    params.ignore_eos = True
    req = ("s", prompt(21, seed=6), params)
    first = run(make_engine(), [req])["s"].output_token_ids
    again = run(make_engine(), [req])["s"].output_token_ids
    others = [(f"o{i}", prompt(9 + 13 * i, seed=30 + i), GREEDY) for i in range(4)]
    batched = run(make_engine(), [*others, req], stagger=1)["s"].output_token_ids
    reseeded = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, top_k=50, seed=124)
    reseeded.ignore_eos = True
    other_seed = run(make_engine(), [("s", req[1], reseeded)])["s"].output_token_ids
    assert first == again == batched
    assert other_seed != first


def test_sampler_rows() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0], [1.0, 0.5, 2.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [SamplingRow(greedy, 1, 0), SamplingRow(greedy, 1, 0)]) == [1, 2]
    top1 = SamplingParams(temperature=1.0, top_k=1)
    assert sample(logits, [SamplingRow(top1, 5, i) for i in range(2)]) == [1, 2]
    nucleus = SamplingParams(temperature=1.0, top_p=0.01)
    assert sample(logits[1:], [SamplingRow(nucleus, 9, 3)]) == [2]
    # Draws depend on (seed, index) only.
    hot = SamplingParams(temperature=5.0)
    wide = torch.zeros(3, 512)
    a = sample(wide, [SamplingRow(hot, 7, i) for i in range(3)])
    alone = [sample(wide[:1], [SamplingRow(hot, 7, i)])[0] for i in range(3)]
    assert a == alone and len(set(a)) > 1
    assert draw_seed(7, 0) != draw_seed(7, 1) and draw_seed(7, 0) != draw_seed(8, 0)


def test_stop_string_truncates_like_openai() -> None:
    ids = prompt(11, seed=8)
    base = make_engine().generate([ids], SamplingParams(max_tokens=48, temperature=0.0))[0]
    text = base.text
    assert len(text) >= 6, "the fixture model must produce some text"
    stop = text[3:5]
    cut = text.index(stop)
    engine = make_engine()
    engine.add_request("x", ids, SamplingParams(max_tokens=48, temperature=0.0, stop=[stop]))
    deltas, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.text_delta)
            last = out
    assert last is not None and last.finished and last.finish_reason == "stop"
    assert last.text == text[:cut] == "".join(deltas)
    assert base.output_token_ids[: len(last.output_token_ids)] == last.output_token_ids
    assert len(last.output_token_ids) < len(base.output_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("prompt_value", "params", "param"),
    [
        ([1, 2, 3], SamplingParams(temperature=-1.0), "temperature"),
        ([1, 2, 3], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
        ([], SamplingParams(), "prompt"),
        ("", SamplingParams(), "prompt"),
        ([1, 512, 3], SamplingParams(), "prompt"),
        ([1, -1], SamplingParams(), "prompt"),
        ([1, True], SamplingParams(), "prompt"),
        ([5] * 2000, SamplingParams(max_tokens=100), "messages"),
    ],
)
def test_bad_input_refused_before_any_block(prompt_value, params, param) -> None:
    engine = make_engine()
    engine.add_request("ok", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    engine.step()
    free = engine.block_manager.num_free_blocks
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt_value, params)
    assert err.value.param == param
    assert engine.block_manager.num_free_blocks == free
    assert "bad" not in engine.scheduler.requests
    if param == "messages":
        assert err.value.message.startswith(
            "This model's maximum context length is 2048 tokens. However, you requested 2100 "
            "tokens (2000 in the messages, 100 in the completion). Please reduce"
        )


def test_abort_frees_blocks_and_events_are_batched() -> None:
    engine = make_engine(block_size=4)
    engine.add_request("a", prompt(30, seed=9), GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    batch = engine.take_kv_event_batch()
    assert batch is not None and batch.seq == 0
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 30 // 4
    assert engine.take_kv_event_batch() is None  # nothing new since
    engine.step()
    assert engine.abort("a") and not engine.abort("a")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished()
    later = engine.take_kv_event_batch()
    assert later is None or later.seq == 1


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_migration_continues_bit_identically(temperature: float) -> None:
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=99, ignore_eos=True)
    ids = prompt(26, seed=12)
    reference = run(make_engine(block_size=4), [("m", ids, params)])["m"]

    source, dest = make_engine(block_size=4), make_engine(block_size=4)
    source.add_request("m", ids, params)
    streamed = ""
    while len(source.scheduler.requests["m"].output_token_ids) < 9:
        streamed += "".join(o.text_delta for o in source.step())
    source.suspend("m")
    blocks, num_computed = source.request_blocks("m")
    assert num_computed == 26 + 9 - 1 and len(blocks) == -(-num_computed // 4)
    state = source.export_request_state("m")
    reserved = dest.reserve_blocks("incoming-m", len(blocks))
    assert reserved is not None
    dest.write_kv(reserved, source.read_kv(blocks))
    dest.adopt_request(state, reserved, reservation_id="incoming-m")
    source.release_migrated("m")
    assert source.block_manager.num_free_blocks == source.block_manager.num_blocks

    final = None
    while dest.has_unfinished():
        for out in dest.step():
            streamed += out.text_delta
            final = out
    assert final is not None and final.finished
    assert final.output_token_ids == reference.output_token_ids
    assert streamed == reference.text == final.text
    assert dest.block_manager.num_free_blocks == dest.block_manager.num_blocks


def test_adopt_refuses_blocks_not_held() -> None:
    source, dest = make_engine(block_size=4), make_engine(block_size=4)
    source.add_request("m", prompt(10, seed=1), GREEDY)
    source.step()
    state = source.export_request_state("m")
    reserved = dest.reserve_blocks("incoming", 3)
    assert reserved is not None
    with pytest.raises(ValueError, match="not held"):
        dest.adopt_request(state, [b + 1 for b in reserved], reservation_id="incoming")
    dest.free_reservation("incoming")
    assert dest.block_manager.num_free_blocks == dest.block_manager.num_blocks


def test_untaken_kv_events_are_bounded_with_a_seq_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    from instance_agent.engine import llm_engine

    monkeypatch.setattr(llm_engine, "MAX_PENDING_KV_EVENTS", 4)
    engine = make_engine(block_size=4)
    for i in range(6):  # every request stores new blocks; nobody takes the events
        engine.generate([prompt(17, seed=40 + i)], GREEDY)
        assert engine.num_pending_kv_events <= 4
    batch = engine.take_kv_event_batch()
    assert batch is None or batch.seq > 0  # dropped batches left a gap in the numbering
    engine.generate([prompt(17, seed=99)], GREEDY)
    later = engine.take_kv_event_batch()
    assert later is not None and later.seq > (batch.seq if batch else 0)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "abort", "suspend", "resume"]),
            st.integers(0, 5),  # request slot
            st.integers(1, 40),  # prompt length
            st.integers(1, 12),  # max tokens
        ),
        min_size=1,
        max_size=40,
    )
)
def test_random_engine_operations_keep_blocks_consistent(ops) -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=32)
    bm = engine.block_manager
    for op, slot, length, max_tokens in ops:
        rid = f"p{slot}"
        live = engine.scheduler.requests.get(rid)
        if op == "add" and live is None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.5, seed=slot)
            engine.add_request(rid, prompt(length, seed=slot), params)
        elif op == "step":
            engine.step()
        elif op == "abort":
            engine.abort(rid)
        elif op == "suspend" and live is not None and live in engine.scheduler.running:
            engine.suspend(rid)
        elif op == "resume" and rid in engine.scheduler.suspended:
            engine.resume(rid)
        bm.check_integrity()
    for rid in list(engine.scheduler.suspended):
        engine.resume(rid)
    while engine.has_unfinished():
        engine.step()
        bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
