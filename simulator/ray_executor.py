"""A `concurrent.futures.Executor` whose tasks run on a Ray cluster (`pip install kvherd[plan]`).

Contract: `RayExecutor(address)` connects to the cluster at `address` ("auto", "ray://HOST:PORT")
or, with "local", starts one on this machine with `num_cpus` workers; `submit(fn, *args)` runs
`fn(*args)` as one Ray task and returns a standard `Future`. A task whose worker process or node is
lost is run again, up to `max_retries` times (Ray's `max_retries`); an exception `fn` raises is
not retried (a deterministic task would raise it again) and reaches `Future.result()`.
`shutdown()` disconnects (and stops the cluster it started). Ray is imported only here, on first
use; the workers need kvherd importable (installed, or on the driver's PYTHONPATH when local).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class RayExecutor(Executor):
    def __init__(self, address: str, num_cpus: int | None = None, max_retries: int = 3) -> None:
        import ray

        self._ray = ray
        self._max_retries = max_retries
        self._remotes: dict[Callable[..., Any], Any] = {}
        if address == "local":
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        remote = self._remotes.get(fn)
        if remote is None:
            remote = self._ray.remote(max_retries=self._max_retries, retry_exceptions=False)(fn)
            self._remotes[fn] = remote
        future: Future[Any] = remote.remote(*args, **kwargs).future()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._ray.shutdown()
