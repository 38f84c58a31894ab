"""Does a llama-server keep a host prompt cache? Asked of the engine itself, once.

llama-server (``--cache-ram N``, 8192 MiB by default; 0 turns it off) saves a slot's prompt to
host memory before the slot is reused and loads any cached prompt back into whichever slot a
later request gets (tools/server/server-context.cpp ``get_available_slot``, llama-cpp-python
0.3.36). Nothing in ``/props``, ``/slots`` or ``/metrics`` says whether it is on. With it on,
the slots are not the engine's prefix cache, and pinning requests to slots
(routing/llamacpp_slots.py) bypasses it: a request pinned to a slot that holds another prompt
is not looked up in the host cache.

The probe: ``slots + 1`` short prompts that share no token, unpinned, one at a time (the last
one takes the least recently used slot, whose prompt the engine saves to host memory if it
can), then the first one again. With a host cache the engine finds it there (``cache_n`` about
its length), without one nowhere (``cache_n`` 0). ``slots + 2`` one-token requests of ~60
tokens each; the probe's prompts overwrite every slot, so it runs when the gateway first sees
the engine.
"""

from __future__ import annotations

import asyncio

import aiohttp

_WORDS = [
    "amber",
    "basil",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lantern",
    "meadow",
    "nectar",
    "orchid",
    "pepper",
    "quartz",
    "raven",
    "saffron",
    "timber",
    "umber",
    "velvet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
]
PROBE_WORDS = 48


def probe_prompt(i: int) -> str:
    """Prompt ``i`` of the probe: no two share a first word (nor, mostly, a token)."""
    n = len(_WORDS)
    return " ".join(_WORDS[(i * 7 + k * (i + 3)) % n] for k in range(PROBE_WORDS)) + f" {i}."


async def _cached(session: aiohttp.ClientSession, base_url: str, prompt: str) -> tuple[int, int]:
    """(cached, prompt) tokens of one unpinned one-token completion."""
    body = {"prompt": prompt, "n_predict": 1, "cache_prompt": True, "temperature": 0}
    async with session.post(base_url.rstrip("/") + "/completion", json=body) as resp:
        if resp.status != 200:
            raise ValueError(f"probe refused: HTTP {resp.status}")
        timings = (await resp.json(content_type=None)).get("timings") or {}
    cached, computed = int(timings.get("cache_n", 0)), int(timings.get("prompt_n", 0))
    return cached, cached + computed


async def has_host_prompt_cache(
    session: aiohttp.ClientSession, base_url: str, slots: int, timeout_s: float = 30.0
) -> bool | None:
    """True if the engine keeps prompts outside its slots, False if not, None if the probe
    could not tell (the engine refused or timed out)."""
    try:
        async with asyncio.timeout(timeout_s):
            for i in range(max(1, slots) + 1):
                await _cached(session, base_url, probe_prompt(i))
            cached, total = await _cached(session, base_url, probe_prompt(0))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return total > 0 and cached >= total // 2
