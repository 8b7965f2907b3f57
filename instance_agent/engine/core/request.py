"""Request state for the engine core: prompt, output, sampling parameters, progress.

Contract:
- `SamplingParams.validate()` rejects every invalid value with `InvalidRequestError` naming the parameter,
  before a request reaches the block manager, so bad input never holds a block.
- A `Request` owns its token ids (prompt then output, a uint32 `array`: 4 bytes a token, the
  form the block hash and the prefix cache's verification read), how many of them have KV computed
  (`num_computed_tokens`), its status, and the hashes of its full blocks, extended incrementally as it
  grows (`update_block_hashes`). Block ids live in the block manager, keyed by request id. A
  request run with a LoRA adapter (`lora_name`) folds its name into every block hash, as the
  proxy hashes it (`kvherd.block_hash`), so its KV never serves another adapter or the base model.
- Sampling randomness is counter-based: the draw for output token i depends only on (`sampling_seed`, i),
  never on a mutable RNG. A request's sampling state is therefore its seed and its output length, so it
  survives preemption, batching and migration bit-identically.
- `to_state()` / `from_state(state, block_size)` are the request's one serialized form (JSON-ready
  `migration.core.protocol.RequestState` fields): what crosses to a migration's destination, in the
  agents and in the simulator alike. `from_state` rebuilds the tokens and block hashes and refuses
  (`InvalidRequestError`) bad sampling parameters or a KV length that leaves nothing to compute.
- `migration_phase` names where a live request stands for a migration ("decoding", "prefilling",
  "waiting", "suspended").
"""

from __future__ import annotations

import enum
import random
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvherd.block_hash import (
    BlockHash,
    HashAlgo,
    block_hash_chain,
    next_block_hash,
)

REQUEST_ID_IN_USE = "request_id_in_use"  # `InvalidRequestError.code`: the id names a request here


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI error object)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SUSPENDED = "suspended"  # paused by a migration's stop-and-copy
    WAITING_FOR_KV = "waiting_for_kv"  # admitted; its prefix loads from a lower KV tier
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_MIGRATED = "finished_migrated"  # left this instance; continues elsewhere

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_MIGRATED: "migrated",
        }.get(self)


_MAX_SEED = 2**63 - 1


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens", "max_tokens must be an integer")
        if self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise bad("temperature", "temperature must be a number")
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise bad("temperature", f"temperature must be in [0, 100], got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise bad("top_p", "top_p must be a number")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise bad("top_k", "top_k must be an integer")
        if self.top_k < -1:
            raise bad("top_k", f"top_k must be -1 (disabled) or at least 0, got {self.top_k}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not -_MAX_SEED <= self.seed <= _MAX_SEED
        ):
            raise bad("seed", "seed must be a 64-bit integer")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "stop must be a list of non-empty strings")
        if len(self.stop) > 16:
            raise bad("stop", "at most 16 stop strings are allowed")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers")


class Request:
    """One generation request as the engine core sees it."""

    __slots__ = (
        "_hash_algo",
        "arrival_time",
        "block_hashes",
        "block_size",
        "cache_salt",
        "eos_token_id",
        "finish_reason",
        "lora_name",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "priority",
        "request_id",
        "sampling_params",
        "sampling_seed",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        block_size: int,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        eos_token_id: int | None = None,
        hash_algo: HashAlgo = "xxh3_64",
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        # Prompt then output: the sequence whose KV the engine computes. The prompt is its
        # leading `num_prompt_tokens` (not a second copy), and the ids are uint32, not a list of
        # pointers: a simulated fleet holds millions of prompt tokens at once.
        if isinstance(prompt_token_ids, bytes | bytearray | memoryview):
            # array() would read raw bytes as uint32 words, not one id per byte.
            prompt_token_ids = list(prompt_token_ids)
        try:
            self.token_ids = array("I", prompt_token_ids)
        except (OverflowError, TypeError) as exc:
            raise InvalidRequestError(
                "prompt token ids must be integers in [0, 2**32)", "prompt"
            ) from exc
        self.num_prompt_tokens = len(self.token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        # Unseeded requests still get a fixed seed, so their sampling state is migratable.
        self.sampling_seed = (
            sampling_params.seed
            if sampling_params.seed is not None
            else random.SystemRandom().getrandbits(63)
        )
        self.block_size = block_size
        self.arrival_time = arrival_time
        self.priority = priority  # lower value is served first (vLLM's convention)
        self.cache_salt = cache_salt
        self.lora_name = lora_name  # the LoRA adapter it runs with (None: the base model)
        self.eos_token_id = eos_token_id
        self._hash_algo: HashAlgo = hash_algo
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until scheduled
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.block_hashes: list[BlockHash] = []
        self.update_block_hashes()

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt's token ids."""
        return self.token_ids[: self.num_prompt_tokens].tolist()

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        """True while some prompt (or recomputed) tokens still lack KV."""
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    # -- growth ------------------------------------------------------------------------------
    def update_block_hashes(self) -> None:
        """Extend `block_hashes` to cover every full block of `token_ids`."""
        hashes = self.block_hashes
        have = len(hashes)
        bs = self.block_size
        tokens = self.token_ids
        if (have + 1) * bs > len(tokens):
            return
        lora = self.lora_name
        # One more block (a decode step filled it): the cheap hash, which folds in no extra key.
        if have and lora is None and (have + 2) * bs > len(tokens):
            hashes.append(
                next_block_hash(hashes[-1], tokens[have * bs : (have + 1) * bs], self._hash_algo)
            )
            return
        parent = hashes[-1] if have else None
        hashes.extend(
            block_hash_chain(
                tokens,
                bs,
                self.cache_salt,
                self._hash_algo,
                start=have,
                parent_hash=parent,
                lora_name=lora,
            )
        )

    def append_output_token(self, token_id: int) -> None:
        tokens = self.token_ids
        try:  # first: an id outside uint32 is refused before anything changed
            tokens.append(token_id)
        except (OverflowError, TypeError) as exc:
            raise InvalidRequestError(
                f"token id {token_id!r} is not an integer in [0, 2**32)", "output_token_ids"
            ) from exc
        self.output_token_ids.append(token_id)
        if (len(self.block_hashes) + 1) * self.block_size <= len(tokens):  # a block filled up
            self.update_block_hashes()

    @property
    def migration_phase(self) -> str:
        """Where a live request stands for a migration: "suspended", "decoding" (between steps
        only its newest sampled token lacks KV), "prefilling" or "waiting"."""
        if self.status is RequestStatus.SUSPENDED:
            return "suspended"
        if self.status is RequestStatus.RUNNING:
            decoding = bool(self.output_token_ids) and (
                self.num_computed_tokens == self.num_tokens - 1
            )
            return "decoding" if decoding else "prefilling"
        return "waiting"

    # -- migration state -----------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """Everything another engine needs to continue this request exactly, as JSON-ready
        `migration.core.protocol.RequestState` fields (the engine adds ``emitted_text``)."""
        return {
            "request_id": self.request_id,
            "prompt_token_ids": self.prompt_token_ids,
            "output_token_ids": list(self.output_token_ids),
            "sampling_params": asdict(self.sampling_params),
            "sampling_seed": self.sampling_seed,
            "num_computed_tokens": self.num_computed_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
            "priority": self.priority,
            "cache_salt": self.cache_salt,
            "lora_name": self.lora_name,
            "arrival_time": self.arrival_time,
            "eos_token_id": self.eos_token_id,
        }

    @classmethod
    def from_state(
        cls, state: Mapping[str, Any], block_size: int, hash_algo: HashAlgo = "xxh3_64"
    ) -> Request:
        """The request `to_state` described, its KV computed for ``num_computed_tokens`` tokens.

        Raises `InvalidRequestError` (a ValueError) for invalid sampling parameters or a KV
        length that leaves no token to compute."""
        params = SamplingParams(**state["sampling_params"])
        params.validate()
        request = cls(
            state["request_id"],
            state["prompt_token_ids"],
            params,
            block_size,
            arrival_time=state["arrival_time"],
            priority=state["priority"],
            cache_salt=state["cache_salt"],
            eos_token_id=state["eos_token_id"],
            hash_algo=hash_algo,
            lora_name=state.get("lora_name"),
        )
        request.sampling_seed = state["sampling_seed"]
        outputs = state["output_token_ids"]
        try:
            request.token_ids.fromlist(list(outputs))
        except (OverflowError, TypeError) as exc:
            raise InvalidRequestError(
                "output token ids must be integers in [0, 2**32)", "output_token_ids"
            ) from exc
        request.output_token_ids = list(outputs)
        request.update_block_hashes()
        request.num_computed_tokens = state["num_computed_tokens"]
        request.num_cached_tokens = state["num_cached_tokens"]
        request.num_preemptions = state.get("num_preemptions", 0)
        if not 0 < request.num_computed_tokens < request.num_tokens:
            raise InvalidRequestError(
                "num_computed_tokens must leave at least one token to compute",
                "num_computed_tokens",
            )
        return request

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop conditions (stop strings are the detokenizer's job)."""
        params = self.sampling_params
        outputs = self.output_token_ids
        if outputs:
            last = outputs[-1]
            if not params.ignore_eos and last == self.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and last in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if len(outputs) >= params.max_tokens or len(self.token_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


def pull_carrier(request: Request, num_blocks: int) -> Request:
    """The owner under which an instance holds `request`'s leading `num_blocks` blocks that
    another instance's copy filled (a prefix pull): the same tokens and hashes, so caching them
    is `BlockManager.cache_full_blocks` (with ``num_computed_tokens`` set to what landed)."""
    bs = request.block_size
    return Request(
        f"pull:{request.request_id}",
        request.token_ids[: num_blocks * bs],
        SamplingParams(max_tokens=1, seed=0),
        bs,
        cache_salt=request.cache_salt,
        hash_algo=request._hash_algo,
        lora_name=request.lora_name,
    )
