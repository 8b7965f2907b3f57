"""LoRA affinity: how much an instance's adapter residency favours it for a request's adapter.

Source: llm-d's ``lora-affinity-scorer`` (the Gateway API Inference Extension's LoRA affinity,
also AIBrix's LoRA-aware routing): an instance that holds the adapter (running or waiting, as
vLLM's ``vllm:lora_requests_info`` says) scores `LOADED` 1.0, one with a free adapter slot
(fewer active adapters than ``max_loras``) `FREE_SLOT` 0.8, one that would have to evict an
adapter `EVICT` 0.0. An instance whose slot count is unknown (no LoRA request seen yet) counts
as having a free slot. A request without an adapter scores every instance 1.0.
- `affinity(adapter, inst)` is the one definition; `LoraAffinityScorer` scores a pipeline's
  instances with it (``lora-affinity-scorer``), so weights decide how far load can outweigh it;
  `KvherdDispatch` prices the same three cases in prefill tokens (its ``lora_*_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.views import ClusterView, InstanceView, RequestView

LOADED = 1.0
FREE_SLOT = 0.8
EVICT = 0.0


def affinity(adapter: str | None, inst: InstanceView) -> float:
    if adapter is None or adapter in inst.active_adapters:
        return LOADED
    if inst.lora_slots == 0 or len(inst.active_adapters) < inst.lora_slots:
        return FREE_SLOT
    return EVICT


class LoraAffinityScorer:
    type_name = "lora-affinity-scorer"

    def score(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> dict[str, float]:
        adapter = request.adapter
        return {inst.instance_id: affinity(adapter, inst) for inst in instances}
