"""Which models the engines themselves serve: their ``GET /v1/models`` answers, merged.

A gateway configured without a ``models`` table serves whatever its engines serve, so its own
``/v1/models`` lists the engines' model ids (vLLM's ``--served-model-name``, llama.cpp's
``--alias``), not a predictor profile name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import aiohttp

log = logging.getLogger(__name__)


async def _models_of(session: aiohttp.ClientSession, url: str, timeout_s: float) -> list[str]:
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(f"{url}/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                return []
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("GET %s/v1/models failed: %s", url, exc)
        return []
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


async def fetch_served_models(
    session: aiohttp.ClientSession, urls: Iterable[str], timeout_s: float = 1.0
) -> list[str]:
    """Model ids any of the engines at ``urls`` serves, sorted; engines that fail are skipped."""
    answers = await asyncio.gather(*(_models_of(session, u, timeout_s) for u in urls))
    return sorted({m for ids in answers for m in ids})
