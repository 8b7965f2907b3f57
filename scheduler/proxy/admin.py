"""The admin API: fleet membership and policy control, on its own port, always behind a token.

Contract (every route requires ``Authorization: Bearer TOKEN``, else 401 with an OpenAI error
object; bodies are JSON; errors are ``{"error": {"message", "type", "param", "code"}}``):
- ``GET /admin/v1/instances``: every instance with its state (health, draining, in flight, load,
  KV tiers as it reports them, KV event stream and index figures);
  ``GET /admin/v1/instances/{id}``: one of them (404 if unknown).
- ``POST /admin/v1/instances`` ``{"instance_id", "url", "kv_events_endpoint", "replay_endpoint",
  "pull_address", "model", "block_size", "role", "runtime_lora"}``: register, or re-register
  (which resubscribes and resyncs the instance's prefix view; a new kvherd agent with a block
  server warms up from its peers' caches first, `scheduler.handover.WarmUps`, unless
  ``--no-handover``). The URL's host and the event endpoints' hosts must match the operator's
  ``--allow-register`` patterns (default: loopback only), else 403. A block size other than the
  model's is refused with 400 (block hashes would never match). 201 on a new instance, 200 on a
  re-registration.
- ``POST /admin/v1/instances/{id}/heartbeat``: 200, or 404 when the instance is unknown (the agent
  then registers again). A body with ``"draining": true`` (an agent that got SIGTERM) drains the
  instance as the drain route does, so its requests migrate away; an agent never un-drains
  itself, so ``false`` leaves an operator's drain in place. Registered instances that stop
  heartbeating for ``heartbeat_timeout_s`` are removed.
- ``DELETE /admin/v1/instances/{id}``: deregister (404 when unknown).
- ``POST /admin/v1/instances/{id}/drain`` ``{"draining": true|false}`` (default true): stop (or
  resume) routing new requests there; its running requests are live-migrated to other instances
  (the `drain` migration policy, whatever ``--migration-policy`` says); those that fit nowhere
  finish where they are.
- ``POST /admin/v1/instances/{id}/handover``: a draining engine's hot prefixes that no
  survivor holds are pulled by survivors (`scheduler.handover`: kvherd agents, or vLLM servers
  with kvherd's connector); 200 with what moved, 404 when unknown, 409 when not draining
  (``--no-handover``: 200, nothing moved). A registered agent asks for it itself once drained
  (SIGTERM).
- ``GET /admin/v1/charges``: what this replica has in flight per instance, by its own
  accounting (``{"replica", "charges": {id: [inflight, pending_prefill, pending_tokens,
  blocks]}}``), which its peers (``--peer``) add to their load views (`scheduler.peer_sync`).
- ``GET /admin/v1/models``: each model and adapter the fleet serves with its block size, the
  tokenizer it is routed with (an adapter's parent's), the instances serving it, and the
  requests, prompt blocks and hit blocks routed for it, and how many of them queued.
- ``PUT /admin/v1/instances/{id}/models`` ``{"models": [{"id", "parent"}, ...] | null}``: pin
  what the instance serves (routing by model uses it, polling stops); null learns it again from
  the instance's ``/v1/models``.
- ``POST /admin/v1/migrate`` ``{"request_id", "to"}`` (the fleet's id of the request, or the
  client's ``X-Request-Id`` of it, see `Fleet.request_key`): live-migrate a request in flight to
  instance ``to`` and return the source agent's outcome (200 whether it committed or aborted; the
  body says which and why); 404 for an unknown request or instance, 409 if it is already
  migrating, 502 if the source agent could not be asked. A stream between two attempts (being
  continued elsewhere) is waited for up to ``ORDER_WAIT_S`` until it is placed again, then 409.
- ``GET /admin/v1/policy`` / ``PUT /admin/v1/policy`` ``{"policy": spec, "parameters": {...}}``:
  show or switch the dispatch policy without restarting: a registry name, a ``kvherd.policies``
  entry point, ``module:attr`` of a module the operator allow-listed (``--policy-module``) or a
  YAML pipeline inside the operator's ``--policy-dir`` (`policies.registry.PolicyAllowList`). A
  spec that is refused (``os:system``, ``../../etc/passwd.yaml``) or does not load is a 400,
  nothing of it runs, and the old policy stays.
- ``GET /admin/v1/tenants``: each tenant's rate limits (``rpm``, ``tpm``; null: none) and what
  remains of them; ``PUT``/``POST /admin/v1/tenants/{name}/limits`` ``{"rpm": N|null, "tpm":
  N|null}``: change them at once (a field left out stays; null lifts it; what the tenant used in
  the last minute still counts); 404 for an unknown tenant, 400 for a limit not a positive int.
- ``GET /dashboard``: the live page (`scheduler.proxy.dashboard`); a browser logs in with
  ``/dashboard?token=TOKEN``, whose cookie admits the page's own GETs only.
"""

from __future__ import annotations

import fnmatch
import hmac
import ipaddress
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvherd.wire import OpenAIError
from scheduler.core.load_report import ROLES
from scheduler.core.rate_limit import RateLimits
from scheduler.fleet import Fleet, FleetError, InstanceSpec
from scheduler.handover import HandoverResult, WarmUps, hand_over
from scheduler.model_poller import ModelListError, parse_models
from scheduler.peer_sync import own_charges
from scheduler.proxy.dashboard import Dashboard
from scheduler.proxy.model_tokenizers import ModelTokenizers
from scheduler.proxy.rate_gate import RateGate

LOOPBACK_PATTERNS: tuple[str, ...] = ("127.0.0.0/8", "::1", "localhost")
# How long a migration order waits for a stream being continued to be placed on its next instance.
ORDER_WAIT_S = 10.0


def _error(status: int, message: str, type: str, param: str | None = None) -> Response:
    body = {"error": {"message": message, "type": type, "param": param, "code": None}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


class RegistrationPolicy:
    """Which hosts may register: CIDR blocks, exact names or shell-style patterns (``*.prod``)."""

    def __init__(self, patterns: Sequence[str] = LOOPBACK_PATTERNS) -> None:
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.globs: list[str] = []
        for pattern in patterns:
            try:
                self.networks.append(ipaddress.ip_network(pattern, strict=False))
            except ValueError:
                self.globs.append(pattern.lower())

    def allows_host(self, host: str) -> bool:
        host = host.strip("[]").lower()
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return any(fnmatch.fnmatchcase(host, glob) for glob in self.globs)
        return any(address in net for net in self.networks) or any(
            fnmatch.fnmatchcase(host, glob) for glob in self.globs
        )


def _host_of(address: str) -> str | None:
    parts = urlsplit(address)
    return parts.hostname


def _spec_from_body(body: Any, allow: RegistrationPolicy) -> InstanceSpec:
    if not isinstance(body, dict):
        raise FleetError(400, "body must be a JSON object")
    instance_id = body.get("instance_id")
    url = body.get("url")
    if not isinstance(instance_id, str) or not instance_id or len(instance_id) > 200:
        raise FleetError(400, "'instance_id' must be a non-empty string", "instance_id")
    if not isinstance(url, str) or not url.startswith("http://"):
        raise FleetError(400, "'url' must be an http://host:port URL", "url")
    host = _host_of(url)
    if host is None:
        raise FleetError(400, "'url' has no host", "url")
    if not allow.allows_host(host):
        raise FleetError(
            403, f"registration from {host!r} is not allowed (--allow-register)", "url"
        )
    endpoints: dict[str, str | None] = {}
    for name in ("kv_events_endpoint", "replay_endpoint", "pull_address"):
        value = body.get(name)
        if value is None:
            endpoints[name] = None
            continue
        if not isinstance(value, str) or not value.startswith("tcp://"):
            raise FleetError(400, f"'{name}' must be a tcp://host:port address or null", name)
        ep_host = _host_of(value)
        if ep_host in (None, "*", "0.0.0.0", "::"):
            # Bound on every interface: reachable where the agent's HTTP server is.
            port = value.rsplit(":", 1)[-1]
            value = f"tcp://{host}:{port}"
        elif not allow.allows_host(ep_host):
            raise FleetError(403, f"'{name}' host {ep_host!r} is not allowed", name)
        endpoints[name] = value
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FleetError(400, "'model' must be a string", "model")
    role = body.get("role")
    if role is not None and role not in ROLES:
        raise FleetError(400, f"'role' must be one of {', '.join(ROLES)}", "role")
    block_size = body.get("block_size")
    if block_size is not None and (
        not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0
    ):
        raise FleetError(400, "'block_size' must be a positive integer", "block_size")
    runtime_lora = body.get("runtime_lora", False)
    if not isinstance(runtime_lora, bool):
        raise FleetError(400, "'runtime_lora' must be a boolean", "runtime_lora")
    return InstanceSpec(
        instance_id=instance_id,
        url=url.rstrip("/"),
        kv_events_endpoint=endpoints["kv_events_endpoint"],
        replay_endpoint=endpoints["replay_endpoint"],
        pull_address=endpoints["pull_address"],
        model=model,
        block_size=block_size,
        registered=True,
        role=role,
        runtime_lora=runtime_lora,
    )


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise FleetError(400, f"request body is not valid JSON: {exc}") from exc


def _limits_from_body(body: Any, current: RateLimits) -> RateLimits:
    if not isinstance(body, dict):
        raise FleetError(400, "body must be a JSON object")
    values: dict[str, int | None] = {"rpm": current.rpm, "tpm": current.tpm}
    for name in values:
        if name not in body:
            continue
        value = body[name]
        if value is not None and (type(value) is not int or value <= 0):
            raise FleetError(400, f"'{name}' must be a positive integer or null", name)
        values[name] = value
    return RateLimits(**values)


def build_admin_app(
    fleet: Fleet,
    token: str,
    allow: RegistrationPolicy,
    limits: RateGate | None = None,
    tokenizers: ModelTokenizers | None = None,
    replica: str = "kvherd",
) -> FastAPI:
    if not token:
        raise ValueError("the admin API always requires a token")
    expected = f"Bearer {token}".encode()
    app = FastAPI(title="kvherd admin", docs_url=None, redoc_url=None, openapi_url=None)
    dashboard = Dashboard(fleet, token)
    app.include_router(dashboard.router)
    warm_ups = WarmUps(fleet)

    @app.middleware("http")
    async def require_token(request: Request, call_next: Any) -> Response:
        presented = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(presented, expected) and not dashboard.admits(request):
            return _error(401, "missing or invalid admin token", "authentication_error")
        response: Response = await call_next(request)
        return response

    @app.exception_handler(FleetError)
    async def fleet_error(_: Request, exc: FleetError) -> Response:
        kind = "server_error" if exc.status >= 500 else "invalid_request_error"
        return _error(exc.status, exc.message, kind, exc.param)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return _error(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(404)
    async def not_found(_: Request, __: Exception) -> Response:
        return _error(404, "no such admin route", "not_found_error")

    @app.exception_handler(405)
    async def bad_method(_: Request, __: Exception) -> Response:
        return _error(405, "method not allowed", "invalid_request_error")

    @app.get("/admin/v1/instances")
    async def list_instances() -> Response:
        return _json({"object": "list", "data": fleet.describe()})

    @app.get("/admin/v1/instances/{instance_id}")
    async def show_instance(instance_id: str) -> Response:
        return _json(fleet.describe_one(instance_id))

    @app.post("/admin/v1/instances")
    async def register(request: Request) -> Response:
        spec = _spec_from_body(await _json_body(request), allow)
        created = await fleet.add_instance(spec)
        if created and fleet.settings.handover and spec.kvherd_agent and spec.pull_address:
            warm_ups.start(spec.instance_id)  # ramped once warm
        elif created:
            fleet.ramp(spec.instance_id)
        return _json(fleet.describe_one(spec.instance_id), status=201 if created else 200)

    @app.post("/admin/v1/instances/{instance_id}/heartbeat")
    async def heartbeat(instance_id: str, request: Request) -> Response:
        body = await _json_body(request)
        leaving = isinstance(body, dict) and body.get("draining") is True
        if not fleet.heartbeat(instance_id, leaving=leaving):
            raise FleetError(404, f"unknown instance {instance_id!r}; register again")
        return _json({"instance_id": instance_id, "ok": True})

    @app.delete("/admin/v1/instances/{instance_id}")
    async def deregister(instance_id: str) -> Response:
        if not await fleet.remove_instance(instance_id):
            raise FleetError(404, f"unknown instance {instance_id!r}")
        return _json({"instance_id": instance_id, "deleted": True})

    @app.post("/admin/v1/instances/{instance_id}/drain")
    async def drain(instance_id: str, request: Request) -> Response:
        body = await _json_body(request)
        draining = body.get("draining", True) if isinstance(body, dict) else None
        if not isinstance(draining, bool):
            raise FleetError(400, "'draining' must be true or false", "draining")
        fleet.set_draining(instance_id, draining)
        return _json(fleet.describe_one(instance_id))

    @app.post("/admin/v1/instances/{instance_id}/handover")
    async def handover(instance_id: str) -> Response:
        if instance_id not in fleet.instances:
            raise FleetError(404, f"unknown instance {instance_id!r}")
        if not fleet.cluster.get(instance_id).draining:
            raise FleetError(409, f"{instance_id!r} is not draining: drain it first")
        if not fleet.settings.handover:
            return _json(HandoverResult(instance_id, error="hand-over is off").body())
        return _json((await hand_over(fleet, instance_id)).body())

    @app.get("/admin/v1/charges")
    async def charges() -> Response:
        return _json(own_charges(fleet, replica))

    @app.get("/admin/v1/models")
    async def list_models() -> Response:
        described = fleet.describe_models()
        if tokenizers is not None:
            for model in described:
                model["tokenizer"] = tokenizers.name_of(model["parent"] or model["id"])
        return _json({"object": "list", "data": described})

    @app.put("/admin/v1/instances/{instance_id}/models")
    async def set_models(instance_id: str, request: Request) -> Response:
        body = await _json_body(request)
        models = body.get("models", ()) if isinstance(body, dict) else ()
        try:
            cards = None if models is None else parse_models({"data": models})
        except ModelListError as exc:
            raise FleetError(400, f"'models': {exc}", "models") from None
        fleet.set_models(instance_id, cards)
        return _json(fleet.describe_one(instance_id))

    @app.post("/admin/v1/migrate")
    async def migrate(request: Request) -> Response:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise FleetError(400, "body must be a JSON object")
        request_id, dst = body.get("request_id"), body.get("to")
        if not isinstance(request_id, str) or not request_id:
            raise FleetError(400, "'request_id' must be a non-empty string", "request_id")
        if not isinstance(dst, str) or not dst:
            raise FleetError(400, "'to' must be an instance id", "to")
        if fleet.migration is None:
            raise FleetError(503, "live migration is not running on this scheduler")
        key = fleet.request_key(request_id)
        if await fleet.placement(key, ORDER_WAIT_S) is None and fleet.in_flight(key):
            raise FleetError(
                409,
                f"request {request_id!r} is being continued on another instance; try again",
                "request_id",
            )
        outcome = await fleet.migration.migrate(key, dst)
        if outcome is None:
            raise FleetError(502, f"the agent running {request_id!r} could not be asked")
        return _json(outcome.to_json())

    @app.get("/admin/v1/policy")
    async def get_policy() -> Response:
        return _json(fleet.policy_info())

    @app.put("/admin/v1/policy")
    @app.post("/admin/v1/policy")
    async def set_policy(request: Request) -> Response:
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("policy"), str):
            raise FleetError(400, "'policy' must be a policy name or spec string", "policy")
        parameters = body.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise FleetError(400, "'parameters' must be an object", "parameters")
        fleet.set_policy(body["policy"], parameters)
        return _json(fleet.policy_info())

    @app.get("/admin/v1/tenants")
    async def list_tenants() -> Response:
        return _json({"object": "list", "data": [] if limits is None else limits.describe()})

    @app.put("/admin/v1/tenants/{tenant}/limits")
    @app.post("/admin/v1/tenants/{tenant}/limits")
    async def set_limits(tenant: str, request: Request) -> Response:
        if limits is None or tenant not in limits.tenants.tenants:
            raise FleetError(404, f"unknown tenant {tenant!r}")
        body = await _json_body(request)
        limits.set_limits(
            tenant, _limits_from_body(body, limits.limiter.limits(tenant) or RateLimits())
        )
        return _json(next(t for t in limits.describe() if t["tenant"] == tenant))

    return app
