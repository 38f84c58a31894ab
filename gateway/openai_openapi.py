"""OpenAPI 3.1 description of the OpenAI endpoints kvgate serves (GET /openapi.json).

Data only, like gateway/admin_openapi.py. Request bodies follow OpenAI's schema for the fields
kvgate reads (model, prompt, messages, max tokens, stream and its options) plus the sampling
fields it forwards untouched; any other field passes through to the engine as the client sent
it, so bodies allow additional properties. Errors are OpenAI error objects. The fuzz suite
(tests/gateway/test_fuzz_openai.py) generates requests from this description.
"""

from __future__ import annotations

from typing import Any

_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 4294967295}
_NULLABLE_NUMBER = {"type": ["number", "null"]}
_POSITIVE = {"type": ["integer", "null"], "minimum": 1}

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                # kvgate's codes are strings; an engine's passed-through error may carry its
                # HTTP status (vLLM's ErrorResponse).
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


_ERRORS = {
    "400": _error("invalid request (names the parameter)"),
    "404": _error("the model does not exist"),
    "405": _error("wrong method"),
    "413": _error("request body too large"),
    "429": _error("rejected by admission: the SLO cannot be met now (Retry-After)"),
    "502": _error("the engine failed before anything reached the client"),
    "503": _error("no capacity or no healthy instance (Retry-After)"),
}

# Fields shared by both endpoints: read by kvgate (stream, max tokens, cache_salt) or forwarded.
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "description": "served model name or alias (GET /v1/models)"},
    "max_tokens": _POSITIVE,
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {
        "type": ["object", "null"],
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 128},
    "stop": {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            {"type": "null"},
        ]
    },
    "seed": {"type": ["integer", "null"]},
    "presence_penalty": _NULLABLE_NUMBER,
    "frequency_penalty": _NULLABLE_NUMBER,
    "user": {"type": "string"},
    "cache_salt": {"type": "string", "minLength": 1, "description": "vLLM cache namespace"},
}

COMPLETION_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {
            "description": "text, token ids, or a batch of one of either",
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                {
                    "type": "array",
                    "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                    "minItems": 1,
                },
            ],
        },
        "echo": {"type": ["boolean", "null"]},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
        "suffix": {"type": ["string", "null"]},
        "add_special_tokens": {"type": "boolean"},
        **_COMMON,
    },
}

_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_IMAGE_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {"type": "object", "properties": {"url": {"type": "string"}}},
    },
}
MESSAGE: dict[str, Any] = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}},
                {"type": "null"},
            ]
        },
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "type", "function"],
                "properties": {
                    "id": {"type": "string"},
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name", "arguments"],
                        "properties": {
                            "name": {"type": "string"},
                            "arguments": {"type": "string"},
                        },
                    },
                },
            },
        },
    },
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
        },
    },
}
CHAT_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        "max_completion_tokens": _POSITIVE,
        "tools": {"type": "array", "items": _TOOL},
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
        "response_format": {"type": "object"},
        "add_generation_prompt": {"type": "boolean"},
        "continue_final_message": {"type": "boolean"},
        "add_special_tokens": {"type": "boolean"},
        "chat_template_kwargs": {"type": "object"},
        **_COMMON,
    },
}

RESPONSES_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": _COMMON["model"],
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object"}, "minItems": 1},
            ],
            "description": "a string, or input items (messages, function calls, their outputs)",
        },
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": _POSITIVE,
        "stream": _COMMON["stream"],
        "previous_response_id": {
            "type": ["string", "null"],
            "minLength": 1,
            "description": "placed on the instance that made that response",
        },
        "tools": {"type": "array", "items": {"type": "object"}},
        "store": {"type": ["boolean", "null"]},
        "temperature": _COMMON["temperature"],
        "top_p": _COMMON["top_p"],
        "cache_salt": _COMMON["cache_salt"],
        "chat_template_kwargs": {"type": "object"},
    },
}

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}
_RESULT = {
    "type": "object",
    "required": ["id", "object", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {"anyOf": [_USAGE, {"type": "null"}]},
    },
}
_HEADERS = [
    {
        "name": "x-kvgate-priority",
        "in": "header",
        "description": "priority class (config slo.priorities)",
        "schema": {"type": "string"},
    },
    {
        "name": "x-slo-ttft-ms",
        "in": "header",
        "description": "this request's TTFT SLO in milliseconds",
        "schema": {"type": "number", "exclusiveMinimum": 0},
    },
    {
        "name": "x-slo-tbt-ms",
        "in": "header",
        "description": "this request's TBT SLO in milliseconds",
        "schema": {"type": "number", "exclusiveMinimum": 0},
    },
]


def _generate(
    summary: str, schema_ref: str, result_ref: str = "#/components/schemas/Result"
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "parameters": _HEADERS,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": schema_ref}}},
            },
            "responses": {
                "200": {
                    "description": "the engine's answer (JSON, or SSE with stream: true)",
                    "content": {
                        "application/json": {"schema": {"$ref": result_ref}},
                        # one schema per event: "data:" lines, the last "[DONE]"
                        "text/event-stream": {
                            "schema": {
                                "type": "object",
                                "properties": {"data": {"type": "string"}},
                            }
                        },
                    },
                },
                **_ERRORS,
            },
        }
    }


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "kvgate OpenAI API",
        "version": "1",
        "description": "OpenAI-compatible completions, chat completions and responses, admitted "
        "and routed "
        "by kvgate to a prefill/decode fleet; bodies are forwarded to the engine unchanged.",
    },
    "components": {
        "schemas": {
            "Error": ERROR_SCHEMA,
            "CompletionRequest": COMPLETION_REQUEST,
            "ChatCompletionRequest": CHAT_REQUEST,
            "ResponsesRequest": RESPONSES_REQUEST,
            "Response": {
                "type": "object",
                "required": ["id", "object", "output"],
                "properties": {
                    "id": {"type": "string"},
                    "object": {"const": "response"},
                    "output": {"type": "array", "items": {"type": "object"}},
                    "status": {"type": "string"},
                    "usage": {"type": ["object", "null"]},
                },
            },
            "Result": _RESULT,
        }
    },
    "paths": {
        "/v1/completions": _generate("Text completion", "#/components/schemas/CompletionRequest"),
        "/v1/chat/completions": _generate(
            "Chat completion", "#/components/schemas/ChatCompletionRequest"
        ),
        "/v1/responses": _generate(
            "Response (colocated pools)",
            "#/components/schemas/ResponsesRequest",
            "#/components/schemas/Response",
        ),
        "/v1/models": {
            "get": {
                "summary": "Served models (config names and aliases, or the engines' own)",
                "responses": {
                    "200": {
                        "description": "model list",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["object", "data"],
                                    "properties": {
                                        "object": {"const": "list"},
                                        "data": {
                                            "type": "array",
                                            "items": {
                                                "type": "object",
                                                "required": ["id", "object"],
                                                "properties": {
                                                    "id": {"type": "string"},
                                                    "object": {"const": "model"},
                                                    "owned_by": {"type": "string"},
                                                },
                                            },
                                        },
                                    },
                                }
                            }
                        },
                    }
                },
            }
        },
        "/health": {
            "get": {
                "summary": "Whether any instance is eligible, and each instance's state",
                "responses": {
                    "200": {"description": "healthy", "content": {"application/json": {}}},
                    "503": {"description": "no healthy instance"},
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {"200": {"description": "text exposition format"}},
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This description",
                "responses": {"200": {"description": "OpenAPI 3.1 document"}},
            }
        },
    },
}
