"""vLLM prefill/decode disaggregation: what each leg carries, per KV connector style.

- ``nixl`` (NixlConnector; the decode pulls KV from the prefill): the prefill leg runs with
  ``max_tokens: 1``, ``stream: false`` and ``kv_transfer_params.do_remote_decode: true``; the
  decode leg is the original body plus the ``kv_transfer_params`` the prefill returned (vLLM's
  toy_proxy_server.py semantics). Same ``X-Request-Id`` on both legs.
- ``shared_storage`` (ExampleConnector, LMCacheConnectorV1 over a shared backend): the prefill
  leg is the same one-token request without parameters (the engine saves the prompt's KV to the
  store); the decode leg is the client's request unchanged (the engine finds the KV by the
  prompt's tokens).

Held blocks (nixl). After its one-token answer the prefill engine pins the prompt's blocks
until a decode engine reads them, or until its lease runs out (vLLM 0.32: 30 s,
``kv_lease_duration``; older releases: ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s). A decode
engine that has *received* the decode request frees them whatever happens next: it reads them,
or when the request is aborted first it notifies the prefill engine to drop them (vLLM PRs
#19223 and #41269). So a client leaving mid-way must not stop the decode leg from reaching the
decode engine: a client that leaves while the prefill runs aborts the prefill (its engine frees
at once); once the prefill has answered, the decode leg is always delivered (shielded from
cancellation) and then aborted, never dropped. Only a decode engine that cannot be reached at
all leaves the blocks to the lease. Reference: shared/reference/peer-routers.md sections 6.1
and 9; llm-d's disaggregation docs name the same window.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from backends import http1
from backends.legs import (
    ForwardPlan,
    Leg,
    UpstreamError,
    UpstreamResponse,
    post_leg,
    read_leg,
)
from config.settings import KVConnector

log = logging.getLogger(__name__)

_PREFILL_ONLY_DROP = ("stream_options", "min_tokens", "min_completion_tokens")
_NO_PARAMS = (
    "prefill answer has no kv_transfer_params: is the prefill engine running with "
    '--kv-transfer-config \'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}\'? '
    '(for a shared KV store set the pool\'s kv_connector = "shared_storage")'
)


def one_token_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's request cut to a one-token, non-streamed prefill."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_ONLY_DROP}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("kv_transfer_params", None)
    return out


def vllm_prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg of vLLM's NIXL protocol."""
    out = one_token_body(body)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(body)
    out["kv_transfer_params"] = dict(params)
    return out


def transfer_params(answer: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill answer, if it has usable ones."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) and params else None


class VLLMDriver:
    """Sequential P/D over vLLM's KV connectors: a one-token prefill, then the decode.

    The style is the prefill target's ``kv_connector`` (None = nixl). Decode legs that must be
    finished after their request was cancelled run as tasks kept in ``self.pending``.
    """

    def __init__(self, client: http1.Http1Client | None = None) -> None:
        self.client = client
        self.pending: set[asyncio.Task[None]] = set()

    async def open(
        self, session: aiohttp.ClientSession | None, plan: ForwardPlan
    ) -> UpstreamResponse:
        if plan.prefill.kv_connector is KVConnector.SHARED_STORAGE:
            return await self._open_shared_storage(session, plan)
        return await self._open_nixl(session, plan)

    async def _prefill(
        self, session: aiohttp.ClientSession | None, plan: ForwardPlan, body: dict[str, Any]
    ) -> Any:
        """Runs the prefill leg to its answer. Cancelled meanwhile, the leg is closed and the
        prefill engine aborts the request (and frees its blocks)."""
        resp = await post_leg(session, plan.prefill, plan, body, self.client)
        try:
            return json.loads(await read_leg(resp))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            raise UpstreamError(
                plan.prefill.instance_id, None, f"bad prefill answer: {exc!r}"
            ) from exc

    async def _open_nixl(
        self, session: aiohttp.ClientSession | None, plan: ForwardPlan
    ) -> UpstreamResponse:
        # The prefill leg is shielded too: a leg closed while the engine is already done with
        # it (the one token computed, the answer on its way) would leave the blocks pinned for
        # the lease with no decode leg to release them. Cancelled, it runs to its answer in the
        # background and its decode leg is delivered and aborted (``_release``).
        prefill = asyncio.ensure_future(self._prefill(session, plan, vllm_prefill_body(plan.body)))
        try:
            answer = await asyncio.shield(prefill)
        except asyncio.CancelledError:
            self._release(session, prefill, plan)
            raise
        params = transfer_params(answer)
        if params is None:
            raise UpstreamError(plan.prefill.instance_id, 502, _NO_PARAMS)
        _prefill_answered(plan)
        # From here the prefill engine holds the prompt's blocks for this decode leg: deliver
        # it even if this request is cancelled, then abort it (the decode engine frees them).
        post = asyncio.ensure_future(
            post_leg(session, plan.decode, plan, decode_body(plan.body, params), self.client)
        )
        try:
            leg = await asyncio.shield(post)
        except asyncio.CancelledError:
            self._abandon(post, plan)
            raise
        except UpstreamError as exc:
            _note_stranded(plan, exc)
            raise
        return UpstreamResponse(leg, plan.decode.instance_id)

    def _release(
        self, session: aiohttp.ClientSession | None, prefill: asyncio.Future[Any], plan: ForwardPlan
    ) -> None:
        """A request cancelled during its prefill: once the prefill answers, its decode leg
        reaches the decode engine and is aborted, which frees the prefill's blocks."""

        async def finish() -> None:
            try:
                params = transfer_params(await prefill)
            except (UpstreamError, asyncio.CancelledError):
                return  # no answer: the prefill engine aborted the request itself
            if params is None:
                return
            body = decode_body(plan.body, params)
            post = post_leg(session, plan.decode, plan, body, self.client)
            self._abandon(asyncio.ensure_future(post), plan)

        task = asyncio.get_running_loop().create_task(finish())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    def _abandon(self, post: asyncio.Future[Leg], plan: ForwardPlan) -> None:
        """Lets a decode leg whose request was cancelled reach its engine, then aborts it."""

        async def finish() -> None:
            try:
                leg = await post
            except UpstreamError as exc:
                _note_stranded(plan, exc)
                return
            leg.close()

        task = asyncio.get_running_loop().create_task(finish())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _open_shared_storage(
        self, session: aiohttp.ClientSession | None, plan: ForwardPlan
    ) -> UpstreamResponse:
        await self._prefill(session, plan, one_token_body(plan.body))
        _prefill_answered(plan)
        body = plan.raw_body if plan.raw_body is not None else plan.body
        leg = await post_leg(session, plan.decode, plan, body, self.client)
        return UpstreamResponse(leg, plan.decode.instance_id)


def _prefill_answered(plan: ForwardPlan) -> None:
    """The decode leg is not sent yet: late decode binding may still move it."""
    if plan.rebind_decode is not None and (moved := plan.rebind_decode()) is not None:
        plan.decode = moved
    if plan.on_prefill_done is not None:
        plan.on_prefill_done()


def _note_stranded(plan: ForwardPlan, exc: UpstreamError) -> None:
    """A decode leg that never reached its engine leaves the prefill's blocks to the lease."""
    if exc.status is None:
        log.warning(
            "request %s: decode leg to %s failed (%s) after its prefill on %s; that engine "
            "holds the prompt's blocks until its KV lease runs out",
            plan.request_id,
            plan.decode.instance_id,
            exc,
            plan.prefill.instance_id,
        )
