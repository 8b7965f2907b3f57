"""The token ids behind prefixes the proxy routed to engines that cannot list their cache (vLLM).

Contract:
- Pure. `PromptBook(capacity_tokens)` keeps chains (a prompt's full-block hashes, first block
  first) with the token ids of those blocks, least recently noted first. `note(chain, token_ids,
  block_size)` adds a chain or refreshes it, and drops every kept chain that is a head of it (the
  new one covers it: a conversation keeps one entry per lineage). Past `capacity_tokens` in all,
  the least recently noted go.
- `recent()` yields (chain, token_ids) most recently noted first. What an instance holds of each
  is the prefix index's word (the engine's KV events), never the book's.
- Hashes are chained (a block's hash covers every block before it), so a chain is known by its last
  hash. Only unkeyed chains belong here (no salt, no adapter): a hand-over recomputes them from the
  tokens alone. Whoever notes checks that.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence

CAPACITY_TOKENS = 1 << 22  # 4M token ids, 16 MiB


class PromptBook:
    def __init__(self, capacity_tokens: int = CAPACITY_TOKENS) -> None:
        self.capacity_tokens = capacity_tokens
        self._chains: OrderedDict[int, tuple[tuple[int, ...], array[int]]] = OrderedDict()
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._chains)

    def note(self, chain: Sequence[int], token_ids: Sequence[int], block_size: int) -> None:
        """`chain` (full blocks of `token_ids`, `block_size` tokens each) was routed just now."""
        if not chain:
            return
        num_tokens = len(chain) * block_size
        if len(token_ids) < num_tokens:
            raise ValueError(
                f"{len(chain)} blocks of {block_size} need over {len(token_ids)} tokens"
            )
        kept = self._chains
        last = chain[-1]
        if last in kept:
            kept.move_to_end(last)
            return
        for head in chain[:-1]:  # heads it covers
            covered = kept.pop(head, None)
            if covered is not None:
                self.num_tokens -= len(covered[1])
        kept[last] = (tuple(chain), array("I", token_ids[:num_tokens]))
        self.num_tokens += num_tokens
        while self.num_tokens > self.capacity_tokens and kept:
            _, (_, dropped) = kept.popitem(last=False)
            self.num_tokens -= len(dropped)

    def recent(self) -> Iterator[tuple[tuple[int, ...], array[int]]]:
        """Every kept (chain, token ids), most recently noted first."""
        return reversed(list(self._chains.values()))
