"""A flood and the recovery after it: one trace shape and one rule for the live fleet and the sim.

Contract:
- `flood_trace(capacity, ...)`: normal load (a request every `normal_gap_s`) for `before_s`, then
  an open-loop flood at `factor` x `capacity` requests/s for `flood_s`, then the normal load again
  for `after_s` (the probes); every request `input_tokens` long with its own first block (no
  prefix shared) and `output_tokens` to generate. `Flood.probe(index)` tells the probes apart.
- `recovered_s(probes, flood_end, normal_s, window_s)`: seconds from the flood's end until the end
  of the first probe from which every probe is served (status 200, to the last) and 90% of those
  sent in the next `window_s` finish within `normal_s`; None when service never recovered. The
  chaos suite (`tests/support/overload_flood.py`) and `bench/overload_sim.py` use it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from simulator.traces import MOONCAKE_BLOCK_SIZE, Trace, TraceRequest


@dataclass(frozen=True, slots=True)
class Flood:
    trace: Trace
    flood_start_s: float
    flood_end_s: float
    first_probe: int  # trace index of the first probe (the normal load after the flood)

    def probe(self, index: int) -> bool:
        return index >= self.first_probe


def flood_trace(
    capacity: float,
    *,
    factor: float = 10.0,
    before_s: float = 3.0,
    flood_s: float = 4.0,
    after_s: float = 10.0,
    normal_gap_s: float = 0.1,
    input_tokens: int = 25,
    output_tokens: int = 32,
    id_block_size: int = MOONCAKE_BLOCK_SIZE,
) -> Flood:
    requests: list[TraceRequest] = []
    blocks = max(1, -(-input_tokens // id_block_size))

    def add(at: float) -> None:
        i = len(requests)
        # Distinct hash ids per request: nothing is shared, every request costs its prefill.
        ids = tuple(i * blocks + b for b in range(blocks))
        requests.append(TraceRequest(i, at, input_tokens, output_tokens, ids))

    t = 0.0
    while t < before_s:
        add(t)
        t += normal_gap_s
    start, gap = before_s, 1.0 / (factor * capacity)
    n = 0
    while (t := start + n * gap) < start + flood_s:
        add(t)
        n += 1
    end = start + flood_s
    first_probe = len(requests)
    t = end
    while t < end + after_s:
        add(t)
        t += normal_gap_s
    trace = Trace("flood", requests, block_size=id_block_size, has_prefix_info=True)
    return Flood(trace, start, end, first_probe)


def recovered_s(
    probes: Sequence[tuple[float, float, int]],
    flood_end: float,
    normal_s: float,
    window_s: float = 2.0,
) -> float | None:
    """See the module contract; `probes` are (sent, latency, status)."""
    ordered = sorted(probes)
    last_sent = ordered[-1][0] if ordered else 0.0
    for k, (sent, latency, status) in enumerate(ordered):
        rest = ordered[k:]
        if status != 200 or latency > normal_s or any(s != 200 for _, _, s in rest):
            continue
        if sent + window_s > last_sent:
            return None  # too late to see a whole window
        window = [lat for t, lat, _ in rest if t < sent + window_s]
        if sum(lat <= normal_s for lat in window) >= 0.9 * len(window):
            return sent + latency - flood_end
    return None
