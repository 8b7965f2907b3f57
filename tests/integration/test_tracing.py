"""OpenTelemetry traces of the proxy's request path (`scheduler.proxy.tracing`) in front of a real
agent: with the SDK's in-memory exporter, a request's spans (admission, route decision, attempt)
form one trace under the client's W3C ``traceparent``; through a real ``kvherd serve
--otlp-endpoint`` they reach an OTLP/HTTP receiver started here (protobuf ``POST /v1/traces``);
a bad endpoint is a CLI error."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from agent_process import agent_process, free_port
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from serve_process import serve_process

from kvherd.cli import main
from scheduler.proxy.tracing import Tracing
from scheduler.serve_cli import add_arguments, serve_fleet

pytestmark = pytest.mark.timeout(120)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
BODY = {"model": "tiny", "prompt": list(range(1, 40)), "max_tokens": 4, "ignore_eos": True}


async def test_a_request_s_spans_form_one_trace_under_the_client_s() -> None:
    exporter = InMemorySpanExporter()
    port, admin_port = free_port(), free_port()
    with agent_process() as agent:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(
            ["--port", str(port), "--admin-port", str(admin_port), "--admin-token", "t",
             "--log-level", "warning", "--instance", agent.instance_spec()]
        )  # fmt: skip
        ready, stop = asyncio.Event(), asyncio.Event()

        async def on_ready(_: object) -> None:
            ready.set()

        tracing = Tracing(exporter, batch=False)
        served = asyncio.ensure_future(
            serve_fleet(args, on_ready=on_ready, stop=stop, handle_signals=False, tracing=tracing)
        )
        try:
            await asyncio.wait_for(ready.wait(), 60)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                plain = await http.post(
                    "/v1/completions", json=BODY, headers={"traceparent": TRACEPARENT}
                )
                streamed = await http.post("/v1/completions", json={**BODY, "stream": True})
            assert plain.status_code == 200 and streamed.status_code == 200
        finally:
            stop.set()
            assert await asyncio.wait_for(served, 30) == 0
    spans = exporter.get_finished_spans()
    traced = [s for s in spans if f"{s.context.trace_id:032x}" == TRACE_ID]
    by_name = {s.name: s for s in traced}
    assert set(by_name) == {"kvherd.request", "kvherd.admission", "kvherd.route", "kvherd.attempt"}
    root = by_name["kvherd.request"]
    assert root.parent is not None and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    assert root.attributes["http.response.status_code"] == 200
    for name in ("kvherd.admission", "kvherd.route", "kvherd.attempt"):
        span = by_name[name]
        assert span.parent is not None and span.parent.span_id == root.context.span_id, name
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time, name
    route = by_name["kvherd.route"].attributes
    assert route["kvherd.instance"] == by_name["kvherd.attempt"].attributes["kvherd.instance"]
    assert route["kvherd.matched_blocks"] >= 0 and route["kvherd.queued"] is False
    assert route["kvherd.candidates"]  # the policy's score per candidate
    assert by_name["kvherd.attempt"].attributes["http.response.status_code"] == 200
    # Without a client traceparent the request starts its own trace, spans alike.
    others = {s.context.trace_id for s in spans if s not in traced}
    assert len(others) == 1 and len(spans) == 8


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[ExportTraceServiceRequest]]]:
    """An OTLP/HTTP receiver on loopback: ``POST /v1/traces`` with a protobuf body."""
    got: list[ExportTraceServiceRequest] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            ok = self.path == "/v1/traces" and "protobuf" in self.headers["content-type"]
            if ok:
                got.append(ExportTraceServiceRequest.FromString(body))
            self.send_response(200 if ok else 404)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", got
    finally:
        server.shutdown()
        server.server_close()


def test_serve_and_agent_export_one_trace_to_an_otlp_receiver(
    receiver: tuple[str, list[ExportTraceServiceRequest]],
) -> None:
    """The proxy's spans and the agent's (`instance_agent.tracing`: the request's queue,
    prefill and decode there) form one trace: the agent's request span is the child of the
    proxy's attempt, whose ``traceparent`` it got."""
    url, got = receiver
    with (
        agent_process("--otlp-endpoint", url) as agent,
        serve_process([agent.instance_spec()], "--otlp-endpoint", url) as served,
    ):
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
        completion = client.completions.create(
            model="tiny", prompt=BODY["prompt"], max_tokens=4,
            extra_headers={"traceparent": TRACEPARENT},
        )  # fmt: skip
        assert completion.choices
    # serve and the agent flushed their batches on the way out (SIGTERM)
    spans = [
        (span, {a.key: a.value.string_value for a in resource.resource.attributes})
        for request in got
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
        if span.trace_id.hex() == TRACE_ID
    ]
    by_name = {span.name: (span, resource) for span, resource in spans}
    proxy = {"kvherd.request", "kvherd.admission", "kvherd.route", "kvherd.attempt"}
    here = {"kvherd.agent.request", "kvherd.agent.queue", "kvherd.agent.prefill"}
    assert set(by_name) == proxy | here | {"kvherd.agent.decode"}, set(by_name)
    assert {by_name[n][1]["service.name"] for n in proxy} == {"kvherd-proxy"}
    assert by_name["kvherd.agent.request"][1]["service.name"] == "kvherd-agent"
    attempt, request = by_name["kvherd.attempt"][0], by_name["kvherd.agent.request"][0]
    assert request.parent_span_id == attempt.span_id
    phases = [by_name[f"kvherd.agent.{n}"][0] for n in ("queue", "prefill", "decode")]
    assert all(p.parent_span_id == request.span_id for p in phases)
    assert request.start_time_unix_nano <= phases[0].start_time_unix_nano
    for before, after in itertools.pairwise(phases):
        assert before.end_time_unix_nano <= after.start_time_unix_nano + 1_000  # 1 us rounding
    assert phases[-1].end_time_unix_nano <= request.end_time_unix_nano
    tokens = {a.key: a.value.int_value for a in request.attributes if a.value.HasField("int_value")}
    assert (
        tokens["kvherd.prompt_tokens"] == len(BODY["prompt"])
        and tokens["kvherd.output_tokens"] == 4
    )


@pytest.mark.parametrize("url", ["ftp://collector:4318", "collector:4318", "http://"])
def test_a_bad_otlp_endpoint_is_a_cli_error(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--admin-token", "t", "--otlp-endpoint", url]) == 2
    assert "--otlp-endpoint must be an http(s):// URL" in capsys.readouterr().err


def test_a_sample_ratio_of_zero_traces_only_the_clients_sampled_requests() -> None:
    """``--otlp-sample-ratio 0``: a request without a ``traceparent`` makes no span; one whose
    client sampled it is traced still (its flag is kept)."""
    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter, batch=False, sample_ratio=0.0)
    dropped = tracing.request(b"/v1/completions", b"r1", None, None)
    dropped.end(200)
    kept = tracing.request(b"/v1/completions", b"r2", TRACEPARENT.encode(), None)
    kept.end(200)
    names = [(s.name, f"{s.context.trace_id:032x}") for s in exporter.get_finished_spans()]
    assert names == [("kvherd.request", TRACE_ID)]


def test_a_sample_ratio_outside_0_1_is_a_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["serve", "--admin-token", "t", "--otlp-endpoint", "http://c:4318"]
    assert main([*args, "--otlp-sample-ratio", "1.5"]) == 2
    assert "--otlp-sample-ratio must be in [0, 1]" in capsys.readouterr().err
