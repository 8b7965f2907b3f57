"""The request path's model checks (`RequestReader`): vLLM's 404 for a model nobody serves, 400
for a mistyped one, an adapter's instances and name (its blocks hashed as vLLM hashes them)."""

from __future__ import annotations

import orjson
import pytest

from kvherd.block_hash import block_hash_chain
from kvherd.tokenizer import load_tokenizer
from kvherd.wire import OpenAIError
from scheduler.fleet import Fleet, FleetSettings
from scheduler.metrics import ProxyMetrics
from scheduler.proxy.model_tokenizers import ModelTokenizers
from scheduler.proxy.routed_request import RequestReader, RoutedRequest


def reader(loadable: dict[str, str | None] | None = None) -> RequestReader:
    fleet = Fleet("kvherd", FleetSettings(block_size=4), ProxyMetrics())
    fleet.models.set_models("la", [{"id": "tiny"}, {"id": "A", "parent": "tiny"}])
    fleet.models.set_models("lb", [{"id": "tiny"}, {"id": "C", "parent": "tiny"}])
    return RequestReader(fleet, ModelTokenizers(load_tokenizer("byte")), loadable)


async def read(reader: RequestReader, model: object) -> RoutedRequest:
    body = orjson.dumps({"model": model, "prompt": "hello world, twelve+", "max_tokens": 1})
    return await reader.read(body, b"/v1/completions", False, None)


async def test_unknown_model_is_vllms_404() -> None:
    with pytest.raises(OpenAIError) as caught:
        await read(reader(), "nope")
    # vLLM 0.32's own answer (tests/vllm/test_vllm_models.py compares the two).
    assert caught.value.status == 404
    assert caught.value.body() == {
        "error": {
            "message": "The model `nope` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize("model", [5, ["A"], {"id": "A"}, True])
async def test_a_model_that_is_not_a_string_is_a_400(model: object) -> None:
    with pytest.raises(OpenAIError) as caught:
        await read(reader(), model)
    assert caught.value.status == 400 and caught.value.param == "model"


async def test_models_route_and_adapters_hash_with_their_name() -> None:
    r = reader(loadable={"D": "tiny"})
    base = await read(r, "tiny")
    assert base.only is None and base.adapter is None
    for absent in (None, ""):
        assert (await read(r, absent)).only is None
    lora = await read(r, "A")
    assert lora.only == frozenset({"la"}) and lora.adapter == "A"
    ids = load_tokenizer("byte").encode("hello world, twelve+")
    assert lora.block_hashes == block_hash_chain(ids, 4, lora_name="A")
    assert lora.block_hashes != base.block_hashes
    new = await read(r, "D")  # no instance has it; the proxy may load it
    assert new.lora_load == "D" and new.adapter == "D"
