"""Test helper: Debian's ``promtool`` and ``prometheus`` binaries, and the metric names in PromQL.

`binary(name)` is the binary's path; without it the test skips, unless
``KVHERD_REQUIRE_PROMETHEUS=1`` (CI), where it fails. `metric_names(expr)` is every kvherd or
vLLM metric a PromQL expression reads (kvherd's names start with ``kvherd_``, vLLM's with
``vllm:``); `family(name)` strips the sample suffixes of counters and histograms.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

REQUIRE_ENV = "KVHERD_REQUIRE_PROMETHEUS"  # "1" in CI: a missing binary fails instead of skipping
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

_METRIC = re.compile(r"(?<![\w:])(?:kvherd_|vllm:)[A-Za-z0-9_:]+")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def binary(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    reason = f"`{name}` is not installed (Debian: apt-get install -y prometheus)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and ${REQUIRE_ENV}=1")
    pytest.skip(reason)


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name
