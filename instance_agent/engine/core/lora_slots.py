"""The engine's LoRA adapter slots: which adapters are resident, loaded and evicted at run time.

Contract:
- `LoraSlots(capacity)` holds at most `capacity` adapters (``--max-loras``); `adapters` is the live
  name -> adapter dict the model runner reads (one object, mutated in place on the engine thread).
- `install(adapter, in_use)` makes an adapter resident. A full table first evicts the least
  recently used adapter that `in_use` says no request runs with; when every slot is in use it
  raises `LoraSlotError`, and so does a name already resident. Returns the evicted name, if any.
- `remove(name, in_use)` unloads one; an unknown name or one in use raises `LoraSlotError`.
- A name keeps the path it was first served from for the engine's life: the prefix cache keys
  blocks by adapter name, so serving other weights under it would hit KV those weights never
  computed. `check_path` refuses that, before any weights are read.
- `touch(name)` marks a use (a request admitted with it), for the LRU order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class _Adapter(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str: ...


A = TypeVar("A", bound=_Adapter)


class LoraSlotError(ValueError):
    """A load or unload the slots cannot do (the message says why)."""


class LoraSlots(Generic[A]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("LoRA slots: capacity must be >= 1")
        self.capacity = capacity
        self.adapters: dict[str, A] = {}
        self._recency: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._paths: dict[str, str] = {}  # every name ever served -> its path

    def check_path(self, name: str, path: str) -> None:
        first = self._paths.get(name)
        if first is not None and first != path:
            raise LoraSlotError(
                f"LoRA adapter {name!r} was served from {first!r}: its cached KV belongs to those "
                f"weights, so it cannot be loaded from {path!r} under the same name"
            )

    def install(self, adapter: A, in_use: Callable[[str], bool]) -> str | None:
        if adapter.name in self.adapters:
            raise LoraSlotError(f"The lora adapter '{adapter.name}' has already been loaded.")
        self.check_path(adapter.name, adapter.path)
        evicted = None
        if len(self.adapters) >= self.capacity:
            evicted = next((n for n in self._recency if not in_use(n)), None)
            if evicted is None:
                raise LoraSlotError(
                    f"every LoRA slot ({self.capacity}) holds an adapter that requests run with"
                )
            self._drop(evicted)
        self.adapters[adapter.name] = adapter
        self._recency[adapter.name] = None
        self._paths[adapter.name] = adapter.path
        return evicted

    def remove(self, name: str, in_use: Callable[[str], bool]) -> None:
        if name not in self.adapters:
            raise LoraSlotError(f"The lora adapter '{name}' cannot be found.")
        if in_use(name):
            raise LoraSlotError(f"LoRA adapter {name!r} has requests running with it")
        self._drop(name)

    def touch(self, name: str) -> None:
        self._recency.move_to_end(name)

    def _drop(self, name: str) -> None:
        del self.adapters[name]
        del self._recency[name]
