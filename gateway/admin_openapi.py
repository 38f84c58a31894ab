"""OpenAPI 3.1 description of the admin API (served at GET /admin/openapi.json)."""

from __future__ import annotations

from typing import Any


def _obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props}


_ERROR = {
    "description": "OpenAI-shaped error",
    "content": {
        "application/json": {
            "schema": _obj(
                error=_obj(
                    message={"type": "string"},
                    type={"type": "string"},
                    param={"type": ["string", "null"]},
                    code={"type": ["string", "null"]},
                )
            )
        }
    },
}
_ANY = {"content": {"application/json": {"schema": {"type": "object"}}}}
_LIST = {"content": {"application/json": {"schema": {"type": "array", "items": {}}}}}


def _section(name: str, what: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": f"Current {what}",
            "responses": {"200": {"description": what, **_ANY}, "401": _ERROR},
        },
        "put": {
            "summary": f"Change {what} live (partial object; validated like the config file)",
            "requestBody": {"required": True, **_ANY},
            "responses": {
                "200": {"description": f"the new {what}", **_ANY},
                "400": _ERROR,
                "401": _ERROR,
            },
        },
    }


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "kvgate admin API",
        "version": "1",
        "description": "Tune SLOs, policy and admission live; manage instances; inspect state.",
    },
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    "security": [{"bearer": []}],
    "paths": {
        "/admin/slo": _section("slo", "SLO settings (global and per priority class)"),
        "/admin/routing": _section("routing", "routing policy and its parameters"),
        "/admin/admission": _section("admission", "admission mode and margins"),
        "/admin/replication/settings": _section("replication", "replication settings"),
        "/admin/instances": {
            "get": {
                "summary": "Instances with their load, health and cache view",
                "responses": {"200": {"description": "instances", **_LIST}, "401": _ERROR},
            },
            "post": {
                "summary": "Add an instance (fields of a pool instance plus 'role')",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": _obj(
                                id={"type": "string"},
                                url={"type": "string"},
                                role={"enum": ["prefill", "decode", "both"]},
                                protocol={"enum": ["vllm", "sglang", "openai"]},
                            ),
                        }
                    },
                },
                "responses": {
                    "201": {"description": "added", **_ANY},
                    "400": _ERROR,
                    "401": _ERROR,
                },
            },
        },
        "/admin/instances/{iid}": {
            "delete": {
                "summary": "Remove an instance (its in-flight requests fail)",
                "parameters": [
                    {"name": "iid", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": {"description": "removed", **_ANY},
                    "404": _ERROR,
                    "401": _ERROR,
                },
            },
        },
        "/admin/instances/{iid}/drain": {
            "post": {
                "summary": 'Stop (or, with {"draining": false}, resume) new work on it',
                "parameters": [
                    {"name": "iid", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": _obj(draining={"type": "boolean"})}},
                },
                "responses": {
                    "200": {"description": "instance", **_ANY},
                    "404": _ERROR,
                    "401": _ERROR,
                },
            },
        },
        "/admin/reload": {
            "post": {
                "summary": "Re-read the config file the gateway started from, validated like "
                "at start-up; a bad file changes nothing (400)",
                "responses": {
                    "200": {"description": "what changed", **_ANY},
                    "400": _ERROR,
                    "409": _ERROR,
                    "401": _ERROR,
                },
            },
        },
        "/admin/state": {
            "get": {
                "summary": "Per-instance queue, predicted TTFT, decode batch, "
                "cache view size, health",
                "responses": {"200": {"description": "state", **_ANY}, "401": _ERROR},
            }
        },
        "/admin/models": {
            "get": {
                "summary": "Served models: pools, instances, SLO, requests in flight",
                "responses": {"200": {"description": "models", **_LIST}, "401": _ERROR},
            }
        },
        "/admin/tenants": {
            "get": {
                "summary": "Tenants: weight, rate limits, number of keys, requests in flight, "
                "share of recent work against the weighted share, outcomes",
                "responses": {"200": {"description": "tenants", **_ANY}, "401": _ERROR},
            }
        },
        "/admin/decisions": {
            "get": {
                "summary": "Recent decisions, predicted vs observed TTFT/TBT",
                "parameters": [{"name": "limit", "in": "query", "schema": {"type": "integer"}}],
                "responses": {
                    "200": {"description": "decisions", **_LIST},
                    "400": _ERROR,
                    "401": _ERROR,
                },
            }
        },
        "/admin/predictors": {
            "get": {
                "summary": "Predictor accuracy and refits",
                "responses": {"200": {"description": "accuracy", **_ANY}, "401": _ERROR},
            }
        },
        "/admin/macro-instances": {
            "get": {
                "summary": "EcoServe macro instances, active member and phases "
                "(rolling_activation)",
                "responses": {
                    "200": {"description": "macro instances", **_ANY},
                    "404": _ERROR,
                    "401": _ERROR,
                },
            }
        },
        "/admin/replication": {
            "get": {
                "summary": "Replication commands (recent, counts)",
                "responses": {"200": {"description": "commands", **_ANY}, "401": _ERROR},
            }
        },
    },
}
