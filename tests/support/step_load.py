"""Client load for scaling tests: threads sending greedy completions back to back until stopped.

`StepLoad(base, threads, prompts, max_tokens, model)` starts at once; each thread cycles through
`prompts` from its own offset, or, `prompts` a function, asks it for the load's k-th prompt.
`answers` holds (prompt, status, text, instance): status 0 is a failed connection, ``instance``
the ``X-Kvherd-Instance`` header (``--expose-instance``). `join()` stops and waits.
`assert_served(*loads)`: every answer of the loads was a 200, and one greedy text per prompt.
`until(check, timeout, what, log)` polls `check` or fails with `log()`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence

import httpx


class StepLoad:
    def __init__(
        self,
        base: str,
        threads: int,
        prompts: Sequence[str] | Callable[[int], str],
        max_tokens: int,
        model: str | None = None,
    ) -> None:
        self.base = base
        self.prompts = prompts
        self._counter = itertools.count()
        self.max_tokens = max_tokens
        self.model = model
        self.stop = threading.Event()
        self.answers: list[tuple[str, int, str, str]] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=300) as client:
            n = 0
            while not self.stop.is_set():
                prompts = self.prompts
                if callable(prompts):
                    prompt = prompts(next(self._counter))
                else:
                    prompt = prompts[(index + n) % len(prompts)]
                n += 1
                body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0}
                if self.model is not None:
                    body["model"] = self.model
                try:
                    r = client.post(f"{self.base}/v1/completions", json=body)
                    text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                    instance = r.headers.get("x-kvherd-instance", "")
                    status = r.status_code
                except httpx.HTTPError as exc:
                    status, text, instance = 0, repr(exc), ""
                with self._lock:
                    self.answers.append((prompt, status, text, instance))

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=300)


def assert_served(*loads: StepLoad) -> None:
    answers = [a for load in loads for a in load.answers]
    failed = [a for a in answers if a[1] != 200]
    assert not failed, failed[:5]
    texts: dict[str, set[str]] = {}
    for prompt, _, text, _ in answers:
        texts.setdefault(prompt, set()).add(text)
    assert all(len(t) == 1 for t in texts.values()), texts  # greedy: one text per prompt


def until(check: Callable[[], bool], timeout: float, what: str, log: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s\n{log()}")
        time.sleep(0.25)  # polling the admin API; the test has no event to wait on
