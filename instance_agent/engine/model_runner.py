"""Model runner: one scheduler step in, sampled tokens out.

Contract:
- Owns the model and the paged KV cache tensor ``[layers, 2, num_blocks, block_size, kv_heads,
  head_dim]`` (block ids are the block manager's).
- `execute(output)` turns a `SchedulerOutput` into one flattened batch (single-token chunks first,
  then longer prefill chunks): token ids, positions, slot mapping from each request's block ids, block
  tables and context lengths; runs the model; computes logits only at the positions that sample; and
  returns ``{request_id: token_id}`` for every scheduled chunk with ``samples`` set. The output index
  of a draw is the request's current output length, which keeps sampling counter-based.
- LoRA: `adapters` (name -> `lora.LoraAdapter`) are the ones requests may name (``lora_name``);
  a step whose chunks name some runs the model with a `lora.LoraBatch` grouping their rows by
  adapter (base-model rows take no update); a step without any passes none.
- `read_kv` / `write_kv` copy whole blocks out of / into the cache (migration).
- Runs on CPU (torch attention) and on CUDA (Triton decode kernel).
"""

from __future__ import annotations

import torch

from instance_agent.engine.attention import build_metadata
from instance_agent.engine.core.batch_scheduler import ScheduledRequest, SchedulerOutput
from instance_agent.engine.loader import LoadedModel
from instance_agent.engine.lora import LoraAdapter, LoraBatch, fused_slices
from instance_agent.engine.model import allocate_kv_cache
from instance_agent.engine.sampler import SamplingRow, sample
from instance_agent.engine.triton_attention import supports


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        adapters: dict[str, LoraAdapter] | None = None,
    ) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_cache = allocate_kv_cache(
            self.config, num_blocks, block_size, self.dtype, self.device
        )
        # Triton decode kernel on CUDA (lazy import); the torch path elsewhere.
        self.use_triton = self.device.type == "cuda" and supports(block_size)
        self._workspace: torch.Tensor | None = None
        self.adapters = adapters if adapters is not None else {}
        self._fused = fused_slices(self.config)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        if not output.scheduled:
            return {}
        bs = self.block_size
        # Single-token chunks (decodes) first: attention runs them as one padded batch.
        order: list[ScheduledRequest] = sorted(
            output.scheduled, key=lambda s: s.num_new_tokens != 1
        )
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        decodes: list[tuple[list[int], int]] = []
        prefills: list[tuple[int, list[int], int, int]] = []
        sample_index: list[int] = []
        rows: list[SamplingRow] = []
        lora_rows: dict[str, list[torch.Tensor]] = {}
        for item in order:
            req = item.request
            start, n = item.num_computed_before, item.num_new_tokens
            query_start = len(token_ids)
            token_ids.extend(req.token_ids[start : start + n])
            pos = torch.arange(start, start + n)
            table = torch.tensor(item.block_ids, dtype=torch.long)
            positions.append(pos)
            if req.lora_name is not None:
                lora_rows.setdefault(req.lora_name, []).append(
                    torch.arange(query_start, query_start + n)
                )
            slots.append(table[pos // bs] * bs + pos % bs)
            if n == 1:
                decodes.append((item.block_ids, start + 1))
            else:
                prefills.append((query_start, item.block_ids, start, n))
            if item.samples:
                sample_index.append(query_start + n - 1)
                rows.append(
                    SamplingRow(req.sampling_params, req.sampling_seed, req.num_output_tokens)
                )
        dev = self.device
        meta = build_metadata(
            bs, decodes, prefills, torch.cat(slots).to(dev), dev, use_triton=self.use_triton
        )
        if decodes and not self.use_triton:
            meta.workspace = self._decode_workspace(len(decodes) * max(len(b) for b, _ in decodes))
        lora = None
        if lora_rows:
            groups = [
                (self.adapters[name], torch.cat(parts).to(dev)) for name, parts in lora_rows.items()
            ]
            lora = LoraBatch(groups, self._fused)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.cat(positions).to(dev),
            self.kv_cache,
            meta,
            lora,
        )
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_index, device=dev)])
        sampled = sample(logits, rows)
        sampling_items = [item for item in order if item.samples]
        return {
            item.request.request_id: tok for item, tok in zip(sampling_items, sampled, strict=True)
        }

    def _decode_workspace(self, num_blocks: int) -> torch.Tensor:
        """Flat scratch for the decode KV gather, grown on demand and kept across steps."""
        cfg = self.config
        needed = 2 * num_blocks * self.block_size * cfg.num_key_value_heads * cfg.head_dim
        if self._workspace is None or self._workspace.numel() < needed:
            self._workspace = torch.empty(needed, dtype=self.dtype, device=self.device)
        return self._workspace

    # -- migration ---------------------------------------------------------------------------
    def _block_index(self, block_ids: list[int]) -> torch.Tensor:
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids must be in [0, {self.num_blocks})")
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def read_kv(self, block_ids: list[int]) -> torch.Tensor:
        """KV of the given blocks, ``[layers, 2, len(block_ids), block_size, kv_heads, head_dim]`` on CPU."""
        return self.kv_cache[:, :, self._block_index(block_ids)].cpu()

    def write_kv(self, block_ids: list[int], data: torch.Tensor) -> None:
        index = self._block_index(block_ids)
        expected = list(self.kv_cache.shape)
        expected[2] = len(block_ids)
        if list(data.shape) != expected:
            raise ValueError(f"KV data has shape {list(data.shape)}, expected {expected}")
        self.kv_cache[:, :, index] = data.to(device=self.device, dtype=self.dtype)
