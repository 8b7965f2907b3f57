"""Two ``kvherd serve`` replicas in front of the same two agents, each the other's ``--peer``.

Replica ``a`` relays long greedy streams; replica ``b`` sees them in its load view within a
moment (``peer_inflight`` per instance, what ``a`` says it has in flight there), and its own
streams run beside them. ``a`` is then killed outright (SIGKILL): only the streams it relayed
break; ``b``'s run to the end with the agents' own greedy output, and ``a``'s charges leave
``b``'s view within their time to live.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from agent_process import agent_processes, free_port
from serve_process import Served, serve_process

pytestmark = pytest.mark.timeout(240)

BODY = {"prompt": "Replicas share the load they route.", "max_tokens": 1800, "temperature": 0.0,
        "ignore_eos": True}


class Stream(threading.Thread):
    """One greedy stream through `base`: its text, or the error that broke it."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.started_reading = threading.Event()
        self.text = ""
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", f"{self.base}/v1/completions", json={**BODY, "stream": True}, timeout=120
            ) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.started_reading.set()
                        self.text += httpx.Response(200, content=line[6:]).json()["choices"][0][
                            "text"
                        ]
                if not self.text:
                    self.error = "no tokens"
        except (httpx.HTTPError, ValueError) as exc:
            self.error = repr(exc)
        finally:
            self.started_reading.set()


def _peer_inflight(served: Served) -> int:
    listed = httpx.get(f"{served.admin_url}/admin/v1/instances", headers=served.admin_headers)
    return sum(int(i["peer_inflight"]) for i in listed.json()["data"])


def _until(check: Callable[[], bool], timeout: float, what: str, *logs: Any) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s\n" + "\n".join(map(str, logs)))
        time.sleep(0.05)


def test_replicas_see_each_others_charges_and_a_dead_one_loses_only_its_streams() -> None:
    with agent_processes(2) as agents:
        specs = [agent.instance_spec() for agent in agents]
        ports_a, ports_b = (free_port(), free_port()), (free_port(), free_port())
        peer_of = {"a": ports_b[1], "b": ports_a[1]}
        flags = ("--peer-interval", "0.05", "--policy", "least_requests")
        with (
            serve_process(
                specs, *flags, "--peer", f"http://127.0.0.1:{peer_of['a']}", ports=ports_a
            ) as a,
            serve_process(
                specs, *flags, "--peer", f"http://127.0.0.1:{peer_of['b']}", ports=ports_b
            ) as b,
        ):
            expected = httpx.post(f"{agents[0].url}/v1/completions", json=BODY, timeout=120)
            expected_text = expected.json()["choices"][0]["text"]
            through_a = [Stream(a.url) for _ in range(3)]
            for stream in through_a:
                stream.started_reading.wait(60)
            _until(lambda: _peer_inflight(b) == 3, 10, "b counting a's 3 streams", a.log())
            assert _peer_inflight(a) == 0
            through_b = [Stream(b.url) for _ in range(2)]
            for stream in through_b:
                stream.started_reading.wait(60)
            _until(lambda: _peer_inflight(a) == 2, 10, "a counting b's 2 streams", b.log())

            a.process.send_signal(signal.SIGKILL)
            a.process.wait(30)
            _until(lambda: _peer_inflight(b) == 0, 10, "a's charges ageing out of b", b.log())
            for stream in through_a + through_b:
                stream.join(120)
            assert all(s.error is not None for s in through_a), [s.text for s in through_a]
            assert [s.error for s in through_b] == [None, None]
            assert [s.text for s in through_b] == [expected_text] * 2
