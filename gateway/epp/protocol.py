"""The ext_proc messages of GIE's endpoint-picker protocol, built and read (no I/O, no state).

GIE's protocol (gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol):
the pick goes out as the ``x-gateway-destination-endpoint`` request header (``ip:port``, or a
comma list: primary first, then fallbacks) and as the same value in the ``envoy.lb`` dynamic
metadata namespace; both must agree. No endpoint is an immediate 503, shedding a 429.
Envoy's ``protocol_config`` (sent on a stream's first message) says how bodies travel: in
``FULL_DUPLEX_STREAMED`` the picker holds its request-headers answer until the body has
ended and then streams the body back itself; in ``BUFFERED`` it answers the headers at once
and the pick rides on the body answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from gateway.epp.pd_sidecar import PREFILLER_HEADER

DESTINATION_HEADER = "x-gateway-destination-endpoint"
# The endpoint that served, as the proxy reports it (GIE; our Envoy config adds it to answers)
SERVED_HEADER = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Envoy caps a streamed body message; GIE sends at most this much per message.
MAX_CHUNK = 62_000
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
STREAMED = processing_mode_pb2.ProcessingMode.STREAMED

Headers = dict[str, str]


@dataclass(frozen=True, slots=True)
class MessageTimeouts:
    """Envoy's ext_proc ``message_timeout`` and ``max_message_timeout``, in seconds: the
    Envoy config is written with them (gateway/epp/envoy.py) and the picker keeps to them. A
    pick answers within ``message_s`` (Envoy's default 200 ms is too short for one that waits
    on a prefix pull); one that waits for decode room first asks Envoy for up to
    ``max_message_s``, so it waits at most ``max_wait_s`` (0 or less: it never waits)."""

    message_s: float = 10.0
    max_message_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.message_s > 0:
            raise ValueError(f"message timeout must be > 0 s, got {self.message_s}")
        if self.max_message_s < 0:
            raise ValueError(f"max message timeout must be >= 0 s, got {self.max_message_s}")

    @property
    def max_wait_s(self) -> float:
        return self.max_message_s - self.message_s


HeaderPairs = Iterable[tuple[bytes | str, bytes | str]]


def header_map(headers: ext.HttpHeaders) -> Headers:
    """Lower-case name -> value (Envoy sends ``raw_value`` bytes; older versions ``value``)."""
    out: Headers = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def _text(v: bytes | str) -> str:
    return v.decode("latin-1") if isinstance(v, bytes) else v


def header_mutation(
    set_headers: HeaderPairs = (), remove: Sequence[str] = ()
) -> ext.HeaderMutation:
    return ext.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=_text(k), raw_value=_text(v).encode("latin-1")),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def destination_metadata(endpoints: Sequence[str]) -> struct_pb2.Struct:
    """``{"envoy.lb": {"x-gateway-destination-endpoint": "a:1,b:2"}}``: Envoy's override_host
    LB policy reads it (the filter must list ``envoy.lb`` in receiving_namespaces)."""
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: {DESTINATION_HEADER: ",".join(endpoints)}})
    return md


def pick_mutation(endpoints: Sequence[str], extra: HeaderPairs = ()) -> ext.HeaderMutation:
    """The pick's headers (``extra`` after the destination); a prefiller header the picker did
    not set is removed."""
    pairs = [(DESTINATION_HEADER, ",".join(endpoints)), *extra]
    ours = any(_text(k).lower() == PREFILLER_HEADER for k, _ in pairs)
    return header_mutation(pairs, () if ours else (PREFILLER_HEADER,))


def routed_headers_response(
    endpoints: Sequence[str], extra: HeaderPairs = ()
) -> ext.ProcessingResponse:
    """Duplex mode: the held request-headers answer, carrying the pick."""
    return ext.ProcessingResponse(
        request_headers=ext.HeadersResponse(
            response=ext.CommonResponse(
                header_mutation=pick_mutation(endpoints, extra),
                clear_route_cache=True,  # the route may depend on the new header
            )
        ),
        dynamic_metadata=destination_metadata(endpoints),
    )


def routed_body_response(
    endpoints: Sequence[str], extra: HeaderPairs = (), body: bytes | None = None
) -> ext.ProcessingResponse:
    """Buffered mode: the body answer carries the pick (headers still go upstream after it),
    and ``body`` in place of the client's when given."""
    return ext.ProcessingResponse(
        request_body=ext.BodyResponse(
            response=ext.CommonResponse(
                header_mutation=pick_mutation(endpoints, extra),
                body_mutation=ext.BodyMutation(body=body) if body is not None else None,
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=destination_metadata(endpoints),
    )


def continue_request_headers() -> ext.ProcessingResponse:
    return ext.ProcessingResponse(request_headers=ext.HeadersResponse())


def continue_request_body() -> ext.ProcessingResponse:
    return ext.ProcessingResponse(request_body=ext.BodyResponse())


def response_headers_reply(extra: HeaderPairs = ()) -> ext.ProcessingResponse:
    common = ext.CommonResponse(header_mutation=header_mutation(extra)) if extra else None
    return ext.ProcessingResponse(response_headers=ext.HeadersResponse(response=common))


def streamed_chunks(body: bytes, end: bool, *, request: bool) -> Iterator[ext.ProcessingResponse]:
    """Duplex mode: ``body`` handed back to Envoy unchanged, in messages of at most
    ``MAX_CHUNK`` bytes; ``end`` marks the last. An empty ``body`` still sends one message."""
    pieces = [body[i : i + MAX_CHUNK] for i in range(0, len(body), MAX_CHUNK)] or [b""]
    for n, piece in enumerate(pieces):
        last = end and n == len(pieces) - 1
        mutation = ext.BodyMutation(
            streamed_response=ext.StreamedBodyResponse(body=piece, end_of_stream=last)
        )
        reply = ext.BodyResponse(response=ext.CommonResponse(body_mutation=mutation))
        if request:
            yield ext.ProcessingResponse(request_body=reply)
        else:
            yield ext.ProcessingResponse(response_body=reply)


def continue_response_body() -> ext.ProcessingResponse:
    return ext.ProcessingResponse(response_body=ext.BodyResponse())


def continue_trailers(request: bool) -> ext.ProcessingResponse:
    if request:
        return ext.ProcessingResponse(request_trailers=ext.TrailersResponse())
    return ext.ProcessingResponse(response_trailers=ext.TrailersResponse())


def immediate(status: int, body: bytes, headers: HeaderPairs = ()) -> ext.ProcessingResponse:
    """An answer Envoy sends the client itself (no upstream): rejections and bad requests."""
    has_type = any(_text(k).lower() == "content-type" for k, _ in headers)
    pairs = list(headers) if has_type else [("content-type", "application/json"), *headers]
    return ext.ProcessingResponse(
        immediate_response=ext.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=header_mutation(pairs),
            body=body,
            details="kvgate_epp",
        )
    )


def extend_message_timeout(seconds: float) -> ext.ProcessingResponse:
    """Ask Envoy to restart the current message's timer with ``seconds`` (a pick that waits
    for decode room). Envoy takes it only up to the filter's ``max_message_timeout`` and
    otherwise ignores it (its ``override_message_timeout_ignored`` counter)."""
    d = duration_pb2.Duration()
    d.FromMilliseconds(max(1, round(seconds * 1000)))
    return ext.ProcessingResponse(override_message_timeout=d)
