"""The live page on the admin port: ``/dashboard``, its JSON feed and its vendored assets.

Contract:
- ``GET /dashboard?token=TOKEN`` (the admin token) sets an HttpOnly, SameSite=Strict cookie
  scoped to ``/dashboard`` and redirects (303) to ``/dashboard``, so the token leaves the
  address bar. The cookie (an HMAC of the token, not the token) admits GETs under
  ``/dashboard`` only (`admits`); the rest of the admin API still needs the bearer token.
- ``GET /dashboard``: the page; ``GET /dashboard/assets/{name}``: its script and uPlot (MIT,
  vendored in ``dashboard_assets/``; nothing is fetched from elsewhere at run time).
- ``GET /dashboard/data``: ``{"now", "states", "instances", "time", "charts"}``. Each call samples
  the proxy's metrics (requests by status, refusals, migrations, P/D handoffs, continuations,
  prefix pulls, scale events, prefix blocks moved at resizes), the instances serving and out of
  routing, each instance's load (`Fleet.describe`) and the TTFT and inter-token histograms
  scraped from every instance's ``/metrics`` (summed over the fleet) into a `FleetTimeline`;
  charts are its rates, gauges and quantiles over the last minutes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Iterable
from importlib import resources
from typing import Any

import httpx
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from prometheus_client.parser import text_string_to_metric_families

from kvherd.fleet_token import auth_headers
from scheduler.core.fleet_timeline import QUANTILES, FleetTimeline, Key, Sample, Series
from scheduler.fleet import Fleet

COOKIE = "kvherd_dashboard"
SCRAPE_TIMEOUT_S = 1.0
ASSETS = {
    "dashboard.js": "text/javascript",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "LICENSE.uPlot": "text/plain",
}
# (chart group, proxy counter family, label, the label's values from the metric's contract).
_COUNTERS = (
    ("requests", "kvherd_requests", "status", ("200",)),
    ("refusals", "kvherd_rejected", "reason", ("queue_wait", "queue_full", "queue_timeout")),
    ("migrations", "kvherd_migrations", "outcome", ("committed", "failed")),
    ("handoffs", "kvherd_pd_handoffs", "outcome", ("ok", "fallback", "failed")),
    ("continuations", "kvherd_continuations", "outcome", ("continued", "gave_up")),
    ("prefix_pulls", "kvherd_prefix_pulls", "outcome", ("landed", "failed")),
    ("scale_events", "kvherd_scale_events", "direction", ("out", "in")),
    ("handover", "kvherd_handover_blocks", "outcome", ("pulled", "failed")),
)
_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}
# (id, title, unit, kind, group): kind is "rate", "gauge" or "quantiles".
_CHARTS = (
    ("requests", "Requests by status", "req/s", "rate", "requests"),
    ("ttft", "Time to first token", "s", "quantiles", "ttft"),
    ("itl", "Inter-token latency", "s", "quantiles", "itl"),
    ("refusals", "Refusals by reason", "req/s", "rate", "refusals"),
    ("running", "Running per instance", "requests", "gauge", "running"),
    ("waiting", "Waiting per instance", "requests", "gauge", "waiting"),
    ("kv_usage", "KV cache usage per instance", "fraction", "gauge", "kv_usage"),
    ("migrations", "Migrations by outcome", "per s", "rate", "migrations"),
    ("handoffs", "P/D handoffs by outcome", "per s", "rate", "handoffs"),
    ("continuations", "Continuations by outcome", "per s", "rate", "continuations"),
    ("prefix_pulls", "Prefix pulls by outcome", "per s", "rate", "prefix_pulls"),
    ("instances", "Instances", "instances", "gauge", "instances"),
    ("scale_events", "Scale events by direction", "per s", "rate", "scale_events"),
    ("handover", "Prefix blocks moved at resizes", "blocks/s", "rate", "handover"),
)


def _asset(name: str) -> bytes:
    return resources.files("scheduler.proxy").joinpath("dashboard_assets", name).read_bytes()


class Dashboard:
    def __init__(self, fleet: Fleet, token: str, timeline: FleetTimeline | None = None) -> None:
        self.fleet = fleet
        self._token = token
        self._cookie = hmac.new(token.encode(), b"kvherd dashboard", hashlib.sha256).hexdigest()
        self.timeline = timeline or FleetTimeline()
        self.router = APIRouter()
        self.router.add_api_route("/dashboard", self.page, methods=["GET"])
        self.router.add_api_route("/dashboard/data", self.data, methods=["GET"])
        self.router.add_api_route("/dashboard/assets/{name}", self.asset, methods=["GET"])

    def admits(self, request: Request) -> bool:
        """A browser's GET of the page: the login query's token, or the cookie it set."""
        path = request.url.path
        if request.method != "GET" or not (path == "/dashboard" or path.startswith("/dashboard/")):
            return False
        login = request.query_params.get("token")
        if login is not None and path == "/dashboard":
            return hmac.compare_digest(login.encode(), self._token.encode())
        return hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), self._cookie.encode())

    async def page(self, request: Request) -> Response:
        if "token" in request.query_params:
            response = RedirectResponse("/dashboard", status_code=303)
            response.set_cookie(
                COOKIE, self._cookie, path="/dashboard", httponly=True, samesite="strict"
            )
            return response
        return Response(_asset("index.html"), media_type="text/html; charset=utf-8")

    async def asset(self, name: str) -> Response:
        if name not in ASSETS:
            return Response(b"no such asset", status_code=404, media_type="text/plain")
        return Response(_asset(name), media_type=ASSETS[name])

    async def data(self) -> Response:
        described = self.fleet.describe()
        scrapes = await self._scrape([d["url"] for d in described])
        self.timeline.add(self._sample(described, scrapes))
        series = self.timeline.series()
        payload = {
            "now": time.time(),
            "states": self.fleet.state_counts(),
            "instances": [_row(d, s) for d, s in zip(described, scrapes, strict=True)],
            "time": series.t,
            "charts": _charts(series),
        }
        return Response(orjson.dumps(payload), media_type="application/json")

    async def _scrape(self, urls: list[str]) -> list[dict[str, Any]]:
        headers = auth_headers(self.fleet.settings.fleet_token)
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S, headers=headers) as client:
            return list(await asyncio.gather(*(_scrape_one(client, u) for u in urls)))

    def _sample(self, described: list[dict[str, Any]], scrapes: list[dict[str, Any]]) -> Sample:
        counters: dict[Key, float] = {}
        families = {f.name: f for f in self.fleet.metrics.registry.collect()}
        for group, name, label, seeds in _COUNTERS:
            for value in seeds:
                counters[group, value] = 0.0
            for s in families[name].samples if name in families else ():
                if s.name.endswith("_total"):  # summed over the family's other labels
                    key = (group, s.labels[label])
                    counters[key] = counters.get(key, 0.0) + s.value
        serving = sum(d["health"] == "healthy" and not d["draining"] for d in described)
        gauges: dict[Key, float] = {
            ("instances", "serving"): serving,
            ("instances", "out of routing"): len(described) - serving,  # draining, warming, ejected
        }
        for d in described:
            load = d["load"]
            gauges["running", d["instance_id"]] = load["num_running"]
            gauges["waiting", d["instance_id"]] = load["num_waiting"]
            gauges["kv_usage", d["instance_id"]] = load["kv_usage"]
        histograms = {
            key: _summed(s["histograms"].get(name, {}) for s in scrapes)
            for key, name in _HISTOGRAMS.items()
        }
        return Sample(time.time(), counters, gauges, histograms)


def _charts(series: Series) -> list[dict[str, Any]]:
    charts = []
    for chart_id, title, unit, kind, group in _CHARTS:
        lines: dict[str, list[float | None]] = {}
        if kind == "rate":
            lines = {k[1]: list(v) for k, v in series.rates.items() if k[0] == group}
        elif kind == "gauge":
            lines = {k[1]: v for k, v in series.gauges.items() if k[0] == group}
        elif group in series.quantiles:
            lines = {f"p{round(q * 100)}": series.quantiles[group][q] for q in QUANTILES}
        charts.append({"id": chart_id, "title": title, "unit": unit, "lines": lines})
    return charts


async def _scrape_one(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """One instance's histograms we chart and its prefix-cache hits and queries (lifetime)."""
    out: dict[str, Any] = {"histograms": {}, "hits": None, "queries": None}
    try:
        response = await client.get(url + "/metrics")
        response.raise_for_status()
        families = list(text_string_to_metric_families(response.text))
    except (httpx.HTTPError, ValueError):
        return out  # an instance that does not answer is left out of this sample
    for family in families:
        if family.name in _HISTOGRAMS.values():
            buckets: dict[float, float] = {}
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    bound = float(s.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + s.value
            out["histograms"][family.name] = buckets
        elif family.name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
            key = "hits" if family.name.endswith("hits") else "queries"
            out[key] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def _summed(per_instance: Iterable[dict[float, float]]) -> list[tuple[float, float]]:
    total: dict[float, float] = {}
    for buckets in per_instance:
        for bound, count in buckets.items():
            total[bound] = total.get(bound, 0.0) + count
    return sorted(total.items())


def _row(described: dict[str, Any], scrape: dict[str, Any]) -> dict[str, Any]:
    load = described["load"]
    hits, queries = scrape["hits"], scrape["queries"]
    return {
        "instance_id": described["instance_id"],
        "role": described["role"],
        "health": described["health"],
        "draining": described["draining"],
        "inflight": described["inflight"],
        "running": load["num_running"],
        "waiting": load["num_waiting"],
        "kv_usage": load["kv_usage"],
        "tiers": described["tiers"],
        "prefix_hit_rate": hits / queries if queries else None,
    }
