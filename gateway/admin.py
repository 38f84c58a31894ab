"""Admin REST API under /admin: tune SLOs, policy and admission live; manage instances;
inspect state, recent decisions, predictor accuracy and replication commands.

Every change is validated exactly like the config file (same loader, same messages) and
applied without a restart. Bearer-token auth; with no token configured the API refuses all
calls (no default token works).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from config.loader import ConfigError, settings_from_dict, settings_to_dict
from config.settings import InstanceSettings
from gateway.admin_openapi import OPENAPI
from gateway.openai import lone_surrogate
from gateway.runtime import Gateway
from gateway.tenants import TenantGate

Handler = Callable[[Request], Awaitable[Response]]


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": None}},
        status_code=status,
    )


class AdminAPI:
    def __init__(self, gw: Gateway, tenants: TenantGate | None = None) -> None:
        self.gw = gw
        self.tenants = tenants  # the completion handler's (GET /admin/tenants)

    # ------------------------------------------------------------------ plumbing
    def _auth(self, handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            token = self.gw.settings.server.admin_token
            if not token:
                return _error(
                    401,
                    "admin API disabled: set server.admin_token (or KVGATE__SERVER__ADMIN_TOKEN)",
                    "authentication_error",
                )
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return _error(401, "missing or wrong bearer token", "authentication_error")
            return await handler(request)

        return wrapped

    async def _json(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ConfigError("<request>", "", None, f"body is not valid JSON: {exc}") from None
        except RecursionError:
            raise ConfigError("<request>", "", None, "body is nested too deeply") from None
        if not isinstance(data, dict):
            raise ConfigError("<request>", "", data, "body must be a JSON object")
        if (field := lone_surrogate(data)) is not None:  # not text: cannot be answered
            raise ConfigError("<request>", field, None, "holds a lone UTF-16 surrogate")
        return data

    def _apply_section(self, section: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Merge a patch into one settings section, validate the whole, apply it live."""
        current = settings_to_dict(self.gw.settings)
        merged = dict(current.get(section, {}))
        merged.update(patch)
        current[section] = merged
        new = settings_from_dict(current, source=f"PUT /admin/{section}")  # policy included
        self.gw.apply_settings(new)
        return settings_to_dict(new)[section]

    def routes(self) -> list[Route]:
        a = self._auth
        return [
            Route("/admin/openapi.json", self.openapi, methods=["GET"]),
            Route("/admin/slo", a(self.get_section("slo")), methods=["GET"]),
            Route("/admin/slo", a(self.put_section("slo")), methods=["PUT"]),
            Route("/admin/routing", a(self.get_section("routing")), methods=["GET"]),
            Route("/admin/routing", a(self.put_section("routing")), methods=["PUT"]),
            Route("/admin/admission", a(self.get_section("admission")), methods=["GET"]),
            Route("/admin/admission", a(self.put_section("admission")), methods=["PUT"]),
            Route(
                "/admin/replication/settings", a(self.get_section("replication")), methods=["GET"]
            ),
            Route(
                "/admin/replication/settings", a(self.put_section("replication")), methods=["PUT"]
            ),
            Route("/admin/instances", a(self.list_instances), methods=["GET"]),
            Route("/admin/instances", a(self.add_instance), methods=["POST"]),
            Route("/admin/instances/{iid}", a(self.delete_instance), methods=["DELETE"]),
            Route("/admin/instances/{iid}/drain", a(self.drain), methods=["POST"]),
            Route("/admin/state", a(self.state), methods=["GET"]),
            Route("/admin/reload", a(self.reload), methods=["POST"]),
            Route("/admin/models", a(self.models), methods=["GET"]),
            Route("/admin/tenants", a(self.tenant_view), methods=["GET"]),
            Route("/admin/decisions", a(self.decisions), methods=["GET"]),
            Route("/admin/predictors", a(self.predictors), methods=["GET"]),
            Route("/admin/replication", a(self.replication), methods=["GET"]),
            Route("/admin/macro-instances", a(self.macro_instances), methods=["GET"]),
        ]

    # ------------------------------------------------------------------ handlers
    async def openapi(self, request: Request) -> Response:
        return JSONResponse(OPENAPI)

    def get_section(self, section: str) -> Handler:
        async def handler(request: Request) -> Response:
            data = settings_to_dict(self.gw.settings).get(section, {})
            if section == "server":
                data.pop("admin_token", None)
            return JSONResponse(data)

        return handler

    def put_section(self, section: str) -> Handler:
        async def handler(request: Request) -> Response:
            try:
                return JSONResponse(self._apply_section(section, await self._json(request)))
            except ConfigError as exc:  # the policy and its params included
                return _error(400, str(exc), "invalid_request_error", exc.key or None)

        return handler

    async def list_instances(self, request: Request) -> Response:
        return JSONResponse([self._instance_view(iid) for iid in self.gw.conductor.instances])

    async def add_instance(self, request: Request) -> Response:
        gw = self.gw
        try:
            spec_data = await self._json(request)
            current = settings_to_dict(gw.settings)
            pools = current.setdefault("pools", [])
            role, model = spec_data.get("role"), spec_data.get("model")
            # With several models the instance joins a pool of its role serving its model.
            pool = next(
                (
                    p
                    for p in pools
                    if p.get("role") == role and (model is None or p.get("model") == model)
                ),
                None,
            )
            if pool is None:
                pool = {"name": str(role), "role": role, "instances": []}
                pools.append(pool)
            pool.setdefault("instances", []).append(spec_data)
            new = settings_from_dict(current, source="POST /admin/instances")
        except ConfigError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.key or None)
        spec = next(i for i in new.instances() if i.id == spec_data.get("id"))
        gw.add_instance(spec)
        return JSONResponse(self._instance_view(spec.id), status_code=201)

    async def delete_instance(self, request: Request) -> Response:
        iid = request.path_params["iid"]
        if iid not in self.gw.conductor.instances:
            return _error(404, f"no instance {iid!r}", "not_found_error")
        affected = self.gw.remove_instance(iid)
        return JSONResponse({"removed": iid, "requests_failed": affected})

    async def reload(self, request: Request) -> Response:
        """Re-read the config file, validated like at start-up (gateway/reload.py)."""
        from gateway.reload import reload_config

        result = await reload_config(self.gw)
        if result.ok:
            return JSONResponse(result.as_dict())
        status = 409 if self.gw.config_path is None else 400
        return _error(status, result.error or "reload failed", "invalid_request_error")

    async def drain(self, request: Request) -> Response:
        iid = request.path_params["iid"]
        if iid not in self.gw.conductor.instances:
            return _error(404, f"no instance {iid!r}", "not_found_error")
        body = await request.body()
        draining = True
        if body:
            try:
                draining = bool(json.loads(body).get("draining", True))
            except (ValueError, AttributeError, RecursionError):
                return _error(400, 'body must be {"draining": true|false}', "invalid_request_error")
        self.gw.conductor.drain_instance(iid, draining)
        return JSONResponse(self._instance_view(iid))

    def _instance_view(self, iid: str) -> dict[str, Any]:
        gw = self.gw
        now = gw.clock()
        inst = gw.conductor.instances[iid]
        spec: InstanceSettings | None = gw.specs.get(iid)
        gpu, host = gw.conductor.index.blocks_held(iid) if iid in gw.conductor.index else (0, 0)
        load = gw.scraper.latest(iid, now) if gw.scraper is not None else None
        breaker = gw.legs.breakers.get(iid)
        probe = inst.predictors.prefill.predict(1024, 0)
        return {
            "id": iid,
            "role": inst.role.value,
            "model": inst.model,
            "url": spec.url if spec else None,
            "protocol": spec.protocol.value if spec else None,
            "healthy": inst.healthy,
            "draining": inst.draining,
            "circuit": breaker.state_at(now).value if breaker else None,
            "queued_prefills": len(inst.prefill_queue),
            "queue_s": round(inst.queue_time(now), 4),
            "predicted_ttft_1k_tokens_s": round(inst.queue_time(now) + probe, 4),
            "decode_batch": inst.batch,
            "incoming_decodes": len(inst.incoming),
            "predicted_tbt_s": round(inst.tbt_now(), 5) if inst.batch else None,
            "kv_reserved_tokens": inst.reserved_tokens,
            "cache_view_blocks": {"gpu": gpu, "host": host},
            "engine_metrics": None
            if load is None
            else {
                "running": load.num_running,
                "waiting": load.num_waiting,
                "kv_usage": load.kv_usage,
                "age_s": round(now - load.scraped_at_s, 3),
            },
        }

    async def state(self, request: Request) -> Response:
        gw = self.gw
        c = gw.conductor
        return JSONResponse(
            {
                "policy": c.policy.name,
                "admission": c.admission.mode.value,
                "requests_in_flight": len(c.requests),
                "decisions": c.stats.decisions,
                "rejections": c.stats.rejections,
                "best_effort_admitted": c.stats.best_effort,
                "doomed_warmups": c.stats.warmups,
                "decode_reservation": {
                    "turned_away": c.admission.turned_away_by_reserve,
                    # per served model ("" = the single-model default): share of the recent
                    # shorter prompts that failed the plain TBT check; it acts above min_pressure
                    "pressure": {
                        m or "": round(r.pressure, 4) for m, r in c.admission.reservations.items()
                    },
                },
                # per served model: the share of the classes' TBT headroom in force
                # (routing/tbt_headroom.py; 1 = as configured, until decodes have finished)
                "tbt_headroom_share": {
                    m or "": round(t.share, 3) for m, t in c.admission.tbt_headroom.items()
                },
                # per served model: the factor on predicted queue waits, learned from the
                # admitted requests' first tokens (routing/wait_margin.py; 1 = as predicted)
                "wait_margin": {
                    m or "": round(w.factor, 3) for m, w in c.admission.wait_margins.items()
                },
                # per served model: the share of the colocated decodes' future TBT slack a
                # new prefill may spend (routing/stall_credit.py; only colocated fleets move it)
                "stall_credit": {
                    m or "": round(s.credit, 3) for m, s in c.admission.stall_credits.items()
                },
                "decode_rebinds": c.stats.rebinds,
                "decode_tbt_moves": c.stats.tbt_moves,  # routing/decode_placement.py tbt_fallback
                "decode_queue": {  # routing/decode_queue.py
                    "waiting": len(c.decode_queue),
                    "parked": c.decode_queue.parked,
                    "admitted": c.decode_queue.admitted,
                    "expired": c.decode_queue.expired,
                },
                "cache_view_blocks": len(c.index),
                # per served model ("" = the default): exact or approximate prompt tokens,
                # the segment cache, chat template skeletons (routing/chat_skeleton.py)
                "prompt_identity": {
                    "": gw.prompt_encoder.describe(),
                    **{r.name: r.encoder.describe() for r in gw.model_routes.values() if r.name},
                },
                "instances": [self._instance_view(iid) for iid in c.instances],
            }
        )

    async def models(self, request: Request) -> Response:
        """Per served model: its pools, instances, SLO and requests in flight."""
        c = self.gw.conductor
        in_flight: dict[str | None, int] = {}
        for rec in c.requests.values():
            in_flight[rec.request.model] = in_flight.get(rec.request.model, 0) + 1
        out = []
        for m in self.gw.settings.models:
            insts = [i for i in c.instances.values() if i.model == m.name]
            out.append(
                {
                    "name": m.name,
                    "aliases": list(m.aliases),
                    "pools": list(m.pools),
                    "exact_prompt_tokens": bool(m.model_dir or m.tokenizer_file),
                    "slo": {
                        "ttft_s": m.ttft_s or self.gw.settings.slo.ttft_s,
                        "tbt_s": m.tbt_s or self.gw.settings.slo.tbt_s,
                    },
                    "instances": {i.id: i.eligible for i in insts},
                    "requests_in_flight": in_flight.get(m.name, 0),
                }
            )
        return JSONResponse(out)

    async def tenant_view(self, request: Request) -> Response:
        """Tenants: weights, limits, keys (counted, never shown), in flight, fair share."""
        tenants = self.tenants or TenantGate(self.gw)
        return JSONResponse(tenants.view(self.gw.clock()))

    async def decisions(self, request: Request) -> Response:
        try:
            limit = int(request.query_params.get("limit", "100"))
        except ValueError:
            return _error(400, "limit must be an integer", "invalid_request_error", "limit")
        recent = list(self.gw.learner.decisions)[-max(limit, 0) :]
        return JSONResponse([r.as_dict() for r in reversed(recent)])

    async def predictors(self, request: Request) -> Response:
        return JSONResponse(self.gw.learner.accuracy())

    async def macro_instances(self, request: Request) -> Response:
        """EcoServe macro instances and the phase of each member (rolling_activation only)."""
        policy = self.gw.conductor.policy
        describe = getattr(policy, "macro_instances", None)
        if describe is None:
            return _error(
                404,
                f"policy {policy.name!r} has no macro instances (use rolling_activation)",
                "not_found_error",
            )
        return JSONResponse(
            {
                "policy": policy.name,
                "moves": getattr(policy, "moves", None),
                "switches": getattr(policy, "switches", None),
                "macro_instances": describe(self.gw.clock()),
            }
        )

    async def replication(self, request: Request) -> Response:
        planner = self.gw.conductor.planner
        return JSONResponse(
            {
                "issued": planner.issued,
                "confirmed": planner.confirmed,
                "failed": planner.failed,
                "in_flight": len(planner.in_flight),
                "recent": [r.as_dict() for r in list(self.gw.replicator.log)[-200:]],
            }
        )
