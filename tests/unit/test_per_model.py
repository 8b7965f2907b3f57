"""Per model, a tokenizer, a block size and an index behind one proxy: the flags, the prefix index
at each instance's block size, the fleet's per-model block sizes and mismatch checks, and the
request path hashing each request with its model's tokenizer at its model's block size."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import BlockStored, KVEventBatch
from kvherd.tokenizer import ByteTokenizer, TokenizerUnavailable
from scheduler.core.cluster_state import ClusterState
from scheduler.core.prefix_index import PrefixIndex
from scheduler.fleet import Fleet, FleetError, FleetSettings, InstanceSpec
from scheduler.metrics import ProxyMetrics
from scheduler.proxy.model_tokenizers import ModelTokenizers, parse_tokenizer_specs
from scheduler.proxy.routed_request import RequestReader
from scheduler.serve_cli import block_size_pins

TOKENS = list(range(1, 65))


def _stored(tokens: list[int], block_size: int) -> BlockStored:
    hashes = block_hash_chain(tokens, block_size, algo="sha256")  # an engine's own hash
    return BlockStored(hashes, None, tokens, block_size)


def test_tokenizer_and_block_size_flags(tmp_path: Path) -> None:
    specs = parse_tokenizer_specs(["byte", "alpha=/m/alpha", "org/beta=/m/beta"])
    assert specs.default == "byte"
    assert dict(specs.per_model) == {"alpha": "/m/alpha", "org/beta": "/m/beta"}
    odd = tmp_path / "tok=1"  # an existing path is a DIR whatever it holds
    odd.mkdir()
    assert parse_tokenizer_specs([str(odd)]).default == str(odd)
    assert parse_tokenizer_specs(None).default is None
    for bad in (["a", "b"], ["m=/x", "m=/y"], ["=/x"], ["m="]):
        with pytest.raises(ValueError):
            parse_tokenizer_specs(bad)
    assert block_size_pins(None) == (None, {})
    assert block_size_pins(["16", "beta=32", "org/x=8"]) == (16, {"beta": 32, "org/x": 8})
    for bad in (["0"], ["x"], ["16", "32"], ["b=1", "b=2"], ["=4"], ["b=-1"]):
        with pytest.raises(ValueError):
            block_size_pins(bad)


def test_tokenizers_pick_by_base_model_and_name_the_missing_one() -> None:
    byte = ByteTokenizer()
    other = ByteTokenizer()
    tokenizers = ModelTokenizers(byte, {"beta": other}, parse_tokenizer_specs(["beta=/m/beta"]))
    assert tokenizers.for_model("beta") is other
    assert tokenizers.for_model("alpha") is byte and tokenizers.for_model(None) is byte
    assert tokenizers.named("beta") and not tokenizers.named("alpha")
    assert (tokenizers.name_of("beta"), tokenizers.name_of("alpha")) == ("/m/beta", "byte")
    with pytest.raises(TokenizerUnavailable, match="model 'beta'"):
        ModelTokenizers.load(parse_tokenizer_specs(["beta=/no/such/dir"]))


def test_prefix_index_rehashes_each_instance_at_its_own_block_size() -> None:
    index = PrefixIndex(16)
    index.add_instance("a")  # the index's own size
    index.add_instance("b", block_size=32)
    index.apply_batch("a", KVEventBatch(0, 0.0, [_stored(TOKENS, 16)]))
    index.apply_batch("b", KVEventBatch(0, 0.0, [_stored(TOKENS, 32), _stored(TOKENS, 16)]))
    assert index.match(block_hash_chain(TOKENS, 16)) == {"a": 4}
    assert index.match(block_hash_chain(TOKENS, 32)) == {"b": 2}
    assert index.stats.wrong_block_size == 1  # b's 16-token blocks are not its size
    assert (index.block_size_of("a"), index.block_size_of("b")) == (16, 32)


def test_cluster_set_block_size_clears_the_view_for_a_replay() -> None:
    cluster = ClusterState(block_size=16)
    cluster.add_instance("a", has_kv_events=True)
    cluster.apply_kv_events("a", [_stored(TOKENS, 16)])
    assert cluster.match(block_hash_chain(TOKENS, 16), 0.0) == {"a": 4}
    resync = cluster.set_block_size("a", 32)
    assert resync is not None and resync.replay_from == 0
    assert cluster.get("a").block_size == 32 and cluster.prefix_index.num_blocks("a") == 0
    cluster.apply_kv_events("a", [_stored(TOKENS, 32)])
    assert cluster.match(block_hash_chain(TOKENS, 32), 0.0) == {"a": 2}


def _spec(name: str, model: str, block_size: int | None) -> InstanceSpec:
    cards = [
        {"id": model, "parent": None},
        {"id": f"{model}-lora", "parent": model},
    ]
    return InstanceSpec(name, f"http://127.0.0.1:9/{name}", block_size=block_size, models=cards)


async def test_each_model_settles_its_block_size_and_refuses_another() -> None:
    fleet = Fleet("kvherd", FleetSettings(load_interval_s=60.0), ProxyMetrics())
    try:
        await fleet.add_instance(_spec("a1", "alpha", 16))
        await fleet.add_instance(_spec("b1", "beta", 32))  # another model: its own size
        await fleet.add_instance(_spec("b2", "beta", None))  # learns its model's
        assert fleet.block_size == 16  # the first instance's: requests naming no model
        assert fleet.block_size_of_model("alpha") == 16
        assert fleet.block_size_of_model("beta") == 32
        assert fleet.block_size_of_model(None) == fleet.block_size_of_model("gamma") == 16
        sizes = {i: fleet.cluster.get(i).block_size for i in ("a1", "b1", "b2")}
        assert sizes == {"a1": 16, "b1": 32, "b2": 32}
        with pytest.raises(FleetError) as refused:  # the same model at another size
            await fleet.add_instance(_spec("b3", "beta", 16))
        assert refused.value.status == 400
        assert "model 'beta' hashes with 32" in refused.value.message
        assert "b3" not in fleet.instances
        described = {m["id"]: m for m in fleet.describe_models()}
        assert described["beta-lora"]["block_size"] == 32  # an adapter hashes as its parent
        assert described["beta"]["instances"] == ["b1", "b2"]
        assert fleet.describe_one("b2")["fleet_block_size"] == 32
        # One seen at another size later is flagged and routed approximately, not refused.
        fleet._observe_block_size("b2", 64, "its KV events")
        assert fleet.instances["b2"].block_size_mismatch == {
            "instance_block_size": 64,
            "fleet_block_size": 32,
            "source": "its KV events",
        }
        assert fleet.cluster.get("b2").block_size == 32  # still hashed at its model's size
    finally:
        await fleet.stop()


async def test_a_pinned_block_size_holds_for_every_model_unless_pinned_per_model() -> None:
    settings = FleetSettings(block_size=16, model_block_sizes={"beta": 32}, load_interval_s=60.0)
    fleet = Fleet("kvherd", settings, ProxyMetrics())
    try:
        await fleet.add_instance(_spec("b1", "beta", 32))
        with pytest.raises(FleetError):
            await fleet.add_instance(_spec("g1", "gamma", 32))  # gamma: the fleet-wide 16
        await fleet.add_instance(_spec("g1", "gamma", 16))
        assert (fleet.block_size_of_model("beta"), fleet.block_size_of_model("gamma")) == (32, 16)
    finally:
        await fleet.stop()


class _Doubling(ByteTokenizer):
    """A tokenizer unlike the byte one: each byte twice (so its chain tells which one ran)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [t for t in super().encode(text, add_special_tokens) for _ in (0, 1)]


async def test_requests_hash_with_their_models_tokenizer_and_block_size() -> None:
    fleet = Fleet("kvherd", FleetSettings(load_interval_s=60.0), ProxyMetrics())
    doubling = _Doubling()
    tokenizers = ModelTokenizers(ByteTokenizer(), {"beta": doubling})
    reader = RequestReader(fleet, tokenizers)
    prompt = "the quick brown fox jumps over the lazy dog, twice over"
    try:
        await fleet.add_instance(_spec("a1", "alpha", 4))
        await fleet.add_instance(_spec("b1", "beta", 8))

        async def read(model: str | None) -> tuple[list[int], int, frozenset[str] | None]:
            body = orjson.dumps({"model": model, "prompt": prompt, "max_tokens": 1})
            request = await reader.read(body, b"/v1/completions", False, None)
            return request.block_hashes, request.block_size, request.only

        alpha_ids = ByteTokenizer().encode(prompt)
        beta_ids = doubling.encode(prompt)
        assert await read("alpha") == (block_hash_chain(alpha_ids, 4), 4, frozenset({"a1"}))
        assert await read("beta") == (block_hash_chain(beta_ids, 8), 8, frozenset({"b1"}))
        hashes, size, only = await read("beta-lora")  # the parent's tokenizer and block size
        assert (hashes, size) == (block_hash_chain(beta_ids, 8, lora_name="beta-lora"), 8)
        assert only == frozenset({"b1"})
        assert (await read(None))[:2] == (block_hash_chain(alpha_ids, 4), 4)  # the default
    finally:
        await fleet.stop()


def test_per_model_figures_are_exposed() -> None:
    metrics = ProxyMetrics()
    metrics.model_routed("beta", 5, 0)
    metrics.model_routed("beta", 5, 5, queued=True)
    metrics.model_routed("", 2, 1)
    assert metrics.model_figures() == {"beta": (2, 10, 5, 1), "": (1, 2, 1, 0)}
    text = metrics.render().decode()
    assert 'kvherd_model_hit_blocks_total{model="beta"} 5.0' in text
    assert 'kvherd_model_prompt_blocks_total{model="beta"} 10.0' in text
    assert 'kvherd_model_requests_total{model=""} 1.0' in text
    assert 'kvherd_model_queued_total{model="beta"} 1.0' in text
