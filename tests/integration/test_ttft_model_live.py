"""The TTFT model learned live: two kvherd agents behind kvherd serve, streams of prompts of
several lengths; every first token is one sample, the fit prices uncached prompt tokens, its
quality is on /metrics and the admin API, and a client's TTFT SLO header is validated."""

from __future__ import annotations

import re

import httpx
from agent_process import agent_processes
from serve_process import serve_process


def _gauge(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{name}\{{{wanted}\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name}{{{wanted}}} not exported"
    return float(match.group(1))


def test_first_tokens_fit_a_model_exported_with_its_quality() -> None:
    with (
        agent_processes(2) as agents,
        serve_process([a.url for a in agents]) as served,
        httpx.Client(timeout=60.0) as client,
    ):
        streams = 0
        for k in range(48):
            words = 8 + 40 * (k % 4)  # four prompt lengths, each prompt its own
            body = {
                "model": "tiny", "prompt": f"sample {k} " + "word " * words,
                "max_tokens": 2, "temperature": 0, "stream": True,
            }  # fmt: skip
            with client.stream("POST", served.url + "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                reply.read()
            streams += 1
        text = client.get(served.url + "/metrics").text
        assert _gauge(text, "kvherd_ttft_model_samples", instance="fleet") == streams
        assert _gauge(text, "kvherd_ttft_model_r2", instance="fleet") <= 1.0
        error = _gauge(text, "kvherd_ttft_model_error_ratio", instance="fleet")
        assert 0.0 <= error < 10.0
        per_token = _gauge(text, "kvherd_ttft_model_weight", instance="fleet", term="uncached")
        assert per_token > 0.0  # longer prompts are predicted slower
        described = client.get(
            served.admin_url + "/admin/v1/instances", headers=served.admin_headers
        ).json()
        models = [d["ttft_model"] for d in described["data"]]
        assert sum(m["samples"] for m in models) == streams
        assert all(m["weights_s"] is not None for m in models)  # own fit, or the fleet's
        body = {"model": "tiny", "prompt": "slo " * 20, "max_tokens": 2, "temperature": 0}
        ok = client.post(
            served.url + "/v1/completions", json=body, headers={"X-Kvherd-Slo-Ttft-Ms": "250"}
        )
        assert ok.status_code == 200
        for bad in ("fast", "0", "-5", "nan", "inf", "1e12"):
            reply = client.post(
                served.url + "/v1/completions", json=body, headers={"X-Kvherd-Slo-Ttft-Ms": bad}
            )
            assert reply.status_code == 400, bad
            assert reply.json()["error"]["param"] == "X-Kvherd-Slo-Ttft-Ms"
