"""A real Prometheus, run with deploy/prometheus's config, scrapes a running kvherd fleet.

The proxy's and the agent's series arrive through Prometheus' HTTP API; every metric that the
Grafana dashboard and the alert rules read is one the fleet exposes (so neither can rot when a
metric is renamed); and every dashboard expression evaluates in that Prometheus.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from agent_process import free_port
from live_fleet import LiveFleet
from prometheus_tools import DEPLOY, binary, family, metric_names

DASHBOARD = DEPLOY / "grafana" / "kvherd-fleet.json"
RULES = DEPLOY / "prometheus" / "kvherd-alerts.yml"
# Grafana's variables, as a query over the whole fleet would set them.
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$model_name": ".*", "$instance": ".*"}
ARRIVAL_TIMEOUT_S = 30.0


def _host_port(url: str) -> str:
    return urlsplit(url).netloc


@contextlib.contextmanager
def _prometheus(fleet: LiveFleet, workdir: Path) -> Iterator[str]:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(RULES, workdir)
    (workdir / "targets").mkdir()
    for job, url in (("kvherd-proxy", fleet.served.url), ("kvherd-instances", fleet.agent.url)):
        targets = [{"targets": [_host_port(url)], "labels": {"fleet": "test"}}]
        (workdir / "targets" / f"{job}.json").write_text(json.dumps(targets))
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary("prometheus"),
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def _api(client: httpx.Client, base: str, path: str, **params: str) -> Any:
    response = client.get(base + path, params=params)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


def _wait(what: str, check: Any, workdir: Path) -> Any:
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.HTTPError):
            result = check()
            if result:
                return result
        if time.monotonic() > deadline:
            log = (workdir / "prometheus.log").read_text(errors="replace")
            pytest.fail(f"{what} did not arrive in {ARRIVAL_TIMEOUT_S}s:\n{log[-4000:]}")
        time.sleep(0.5)  # polling interval: the scrape interval is 1 s


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def _rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def _with_variables(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def test_prometheus_scrapes_the_fleet(fleet: LiveFleet, tmp_path: Path) -> None:
    with _prometheus(fleet, tmp_path) as base, httpx.Client(timeout=5.0) as client:

        def targets_up() -> bool:
            active = _api(client, base, "/api/v1/targets")["activeTargets"]
            return {t["labels"]["job"] for t in active if t["health"] == "up"} == {
                "kvherd-proxy",
                "kvherd-instances",
            }

        _wait("both jobs' targets up", targets_up, tmp_path)
        for query in (
            'kvherd_requests_total{job="kvherd-proxy", status="200"} > 0',
            'kvherd_instances{job="kvherd-proxy", state="healthy"} == 1',
            'kvherd_instance_inflight{job="kvherd-proxy"}',
            'vllm:num_requests_running{job="kvherd-instances", model_name="tiny"}',
            'vllm:time_to_first_token_seconds_count{job="kvherd-instances"} > 0',
            'kvherd_kv_tier_blocks{job="kvherd-instances", medium="GPU"} > 0',
        ):
            _wait(
                query,
                lambda q=query: _api(client, base, "/api/v1/query", query=q)["result"],
                tmp_path,
            )
        # The proxy's per-instance series name the fleet's instance (metric_relabel_configs).
        inflight = _api(client, base, "/api/v1/query", query="kvherd_instance_inflight")["result"]
        assert {s["metric"].get("instance_id") for s in inflight} == {f"vm:{fleet.agent.port}"}, (
            inflight
        )

        # Every metric family the fleet exposes, with samples or not (a labelled counter nothing
        # has counted yet, e.g. kvherd_rejected_total, is there as HELP and TYPE only).
        exposed = set(_api(client, base, "/api/v1/metadata"))
        exposed |= {family(name) for name in exposed}
        exprs = _dashboard_exprs() + _rule_exprs()
        referenced = {name for expr in exprs for name in metric_names(expr)}
        missing = sorted(n for n in referenced if n not in exposed and family(n) not in exposed)
        assert not missing, f"referenced but not exposed by the fleet: {missing}"
        assert len(referenced) > 30  # the parse found the dashboard's metrics

        for expr in _dashboard_exprs():
            if expr.startswith("label_values("):
                continue
            _api(client, base, "/api/v1/query", query=_with_variables(expr))  # evaluates
