"""What the engine legs of one placed request are told (the ``ForwardPlan`` a driver opens),
and their opening.

The body as the client sent it (re-encoded only where kvgate changes it: a llama.cpp slot
pin), the targets of the decision, the silence timeout, and the hooks that report back to
the Conductor (prefill done; a decode moved by late binding).
"""

from __future__ import annotations

from backends.drivers import ForwardPlan, UpstreamResponse
from backends.legs import Target
from gateway.openai import ParsedRequest
from gateway.proxy_deps import ProxyGateway
from routing.types import Decision


def forward_plan(
    gw: ProxyGateway, parsed: ParsedRequest, path: str, raw: bytes, d: Decision
) -> ForwardPlan:
    rid = parsed.info.request_id
    headers = {"X-Request-Id": rid}
    if gw.tracing.enabled:
        gw.tracing.inject(headers)

    def prefill_done() -> None:
        gw.conductor.prefill_done(rid, gw.clock())

    def rebind_decode() -> Target | None:
        moved = gw.conductor.rebind_decode(rid, gw.clock())
        return gw.targets[moved] if moved is not None else None

    body = parsed.body
    colocated = d.prefill == d.decode
    slot = gw.pin_slot(rid, d.prefill, parsed.info.block_hashes) if colocated else None
    if slot is not None:  # llama.cpp: wait for the slot that holds the prefix
        body, raw = {**body, "id_slot": slot}, b""
    return ForwardPlan(
        request_id=rid,
        path=path,
        body=body,
        prefill=gw.targets[d.prefill],
        decode=gw.targets[d.decode],
        headers=headers,
        # No byte for this long: the engine is aborted. A whole (non-streamed) answer
        # arrives only after its last token, so its generation time counts too.
        timeout_s=gw.silence_timeout(d, 0 if parsed.stream else parsed.info.max_tokens),
        on_prefill_done=prefill_done,
        rebind_decode=rebind_decode
        if gw.settings.routing.decode_rebind and not colocated
        else None,
        raw_body=raw or None,  # forwarded as the client sent it where it is unchanged
    )


async def open_legs(
    gw: ProxyGateway, parsed: ParsedRequest, path: str, raw: bytes, d: Decision
) -> UpstreamResponse:
    """The decision's legs opened with the pool's driver (a traced span when tracing is on);
    raises UpstreamError, or CancelledError when the client leaves meanwhile."""
    plan = forward_plan(gw, parsed, path, raw, d)
    await gw.restore_slot(parsed.info.request_id)  # a llama.cpp slot file, where one is due
    if gw.tracing.enabled:
        with gw.tracing.tracer.start_as_current_span("kvgate.legs.open"):
            upstream = await gw.driver.open(gw.session, plan)  # type: ignore[arg-type]
    else:
        upstream = await gw.driver.open(gw.session, plan)  # type: ignore[arg-type]
    gw.legs.succeeded(d.prefill)
    return upstream
