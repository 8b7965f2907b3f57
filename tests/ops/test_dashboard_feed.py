"""The admin port's /dashboard: its login, what its cookie admits, its JSON feed and its assets."""

from __future__ import annotations

import time

import httpx
from live_fleet import LiveFleet
from serve_process import ADMIN_TOKEN

from scheduler.proxy.dashboard import ASSETS, COOKIE


def _login(client: httpx.Client) -> None:
    response = client.get("/dashboard", params={"token": ADMIN_TOKEN})
    assert response.status_code == 303 and response.headers["location"] == "/dashboard"
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/dashboard" in cookie
    assert ADMIN_TOKEN not in cookie  # the cookie is derived from the token, not the token


def test_the_page_needs_the_token_and_its_cookie_admits_only_the_page(fleet: LiveFleet) -> None:
    with httpx.Client(base_url=fleet.served.admin_url, timeout=10.0) as client:
        assert client.get("/dashboard").status_code == 401
        assert client.get("/dashboard", params={"token": "wrong"}).status_code == 401
        assert client.get("/dashboard/data").status_code == 401
        _login(client)
        assert client.cookies.get(COOKIE)
        page = client.get("/dashboard")
        assert page.status_code == 200 and "uPlot.iife.min.js" in page.text
        for name, media_type in ASSETS.items():
            asset = client.get(f"/dashboard/assets/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"].startswith(media_type)
        assert client.get("/dashboard/assets/index.html").status_code == 404
        # The cookie is for the page, not the admin API.
        cookie = {"Cookie": f"{COOKIE}={client.cookies[COOKIE]}"}
        assert client.get("/admin/v1/instances", headers=cookie).status_code == 401
        assert client.post("/dashboard/data", headers=cookie).status_code == 401


def test_the_feed_shows_each_instance_and_the_fleets_recent_rates(fleet: LiveFleet) -> None:
    with httpx.Client(base_url=fleet.served.admin_url, timeout=10.0) as client:
        _login(client)
        data = client.get("/dashboard/data").json()
        time.sleep(1.5)  # a second sample: rates are between samples
        data = client.get("/dashboard/data").json()
    (row,) = data["instances"]
    assert row["instance_id"] == f"vm:{fleet.agent.port}" and row["role"] == "mixed"
    assert row["health"] == "healthy" and [t["medium"] for t in row["tiers"]] == ["GPU"]
    assert row["tiers"][0]["num_blocks"] > 0 and row["prefix_hit_rate"] > 0
    assert data["states"]["healthy"] == 1
    charts = {c["id"]: c for c in data["charts"]}
    assert set(charts) >= {"requests", "ttft", "itl", "refusals", "migrations", "handoffs"}
    assert set(charts) >= {"continuations", "running", "waiting", "kv_usage"}
    assert set(charts) >= {"instances", "scale_events", "handover"}
    assert charts["instances"]["lines"]["serving"][-1] == 1
    assert set(charts["scale_events"]["lines"]) == {"out", "in"}
    assert len(data["time"]) >= 1
    assert all(
        len(line) == len(data["time"]) for c in charts.values() for line in c["lines"].values()
    )
    assert charts["requests"]["lines"]["200"][-1] > 0
    assert charts["ttft"]["lines"]["p99"][-1] > 0
    assert set(charts["refusals"]["lines"]) == {"queue_wait", "queue_full", "queue_timeout"}
