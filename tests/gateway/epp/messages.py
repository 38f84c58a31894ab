"""Envoy ext_proc messages for the picker's tests (Envoy's real protobuf types, no Envoy), and
a colocated gateway to pick on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from config.settings import (
    AdmissionMode,
    InstanceSettings,
    PDProtocol,
    PoolSettings,
    Role,
    Settings,
)
from gateway.runtime import Gateway

Mode = processing_mode_pb2.ProcessingMode
URLS = {"a": "http://127.0.0.1:41001", "b": "http://127.0.0.1:41002", "c": "http://localhost:41003"}


def colocated_gateway(
    mode: AdmissionMode = AdmissionMode.EARLY, urls: Mapping[str, str] = URLS, **fields: Any
) -> Gateway:
    """A Gateway (not started) over colocated vLLM instances ``id -> url`` with ``mode``
    admission; ``fields`` replace more of its settings (``slo=``, ``server=`` ...)."""
    insts = tuple(
        InstanceSettings(id=i, url=u, role=Role.BOTH, protocol=PDProtocol.VLLM)
        for i, u in urls.items()
    )
    base = Settings()
    settings = replace(
        base,
        pools=(PoolSettings("workers", Role.BOTH, insts),),
        admission=replace(base.admission, mode=mode),
        **fields,
    )
    return Gateway(settings)


def headers_msg(pairs: dict[str, str], end: bool = False) -> ext.HttpHeaders:
    return ext.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        ),
        end_of_stream=end,
    )


def request_headers_msg(extra: dict[str, str] | None = None, *, duplex: bool = True):
    mode = Mode.FULL_DUPLEX_STREAMED if duplex else Mode.BUFFERED
    h = {":method": "POST", ":path": "/v1/completions", "x-request-id": "rid-1", **(extra or {})}
    return ext.ProcessingRequest(
        request_headers=headers_msg(h),
        protocol_config=ext.ProtocolConfiguration(
            request_body_mode=mode, response_body_mode=Mode.FULL_DUPLEX_STREAMED
        ),
    )


def body_msg(data: bytes, end: bool, response: bool = False) -> ext.ProcessingRequest:
    b = ext.HttpBody(body=data, end_of_stream=end)
    return (
        ext.ProcessingRequest(response_body=b)
        if response
        else ext.ProcessingRequest(request_body=b)
    )


def set_headers_of(mutation: ext.HeaderMutation) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}
