"""The emulator's ``/v1/responses`` against what vLLM 0.32 answered (tests/backends/data):
the same fields, the same events in the same order, the same 404 for a response it did not
make."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import aiohttp

from replay.emulator import RunningEmulator
from tests.replay.emulator.test_server import run

DATA = Path(__file__).parents[2] / "backends" / "data"


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n", 1)
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def _kinds(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Event types, a run of deltas as one (vLLM's detokenizer may join tokens)."""
    return [k for k, _ in itertools.groupby(kind for kind, _ in events)]


def _keys(obj: Any) -> Any:
    """The nested key structure of a JSON value (lists by their first item)."""
    if isinstance(obj, dict):
        return {k: _keys(v) for k, v in obj.items()}
    if isinstance(obj, list) and obj:
        return [_keys(obj[0])]
    return None


def test_whole_and_streamed_answers_have_vllms_shape_and_a_follow_up_its_404() -> None:
    vllm_whole = json.loads((DATA / "vllm_0_32_responses.json").read_text())
    vllm_stream = _events((DATA / "vllm_0_32_responses_stream.txt").read_text())
    got: dict[str, Any] = {}

    async def body(emu: RunningEmulator, s: aiohttp.ClientSession) -> None:
        ask = {"model": "m", "instructions": "Be terse.", "input": "hello " * 30}
        async with s.post(emu.url + "/v1/responses", json={**ask, "max_output_tokens": 4}) as r:
            got["whole"] = (r.status, await r.json())
        stream = {**ask, "max_output_tokens": 5, "stream": True}
        async with s.post(emu.url + "/v1/responses", json=stream) as r:
            got["stream"] = (r.status, r.headers["Content-Type"], (await r.read()).decode())
        made = got["whole"][1]["id"]
        for previous in (made, "resp_nope"):
            again = {"model": "m", "input": "more", "previous_response_id": previous}
            async with s.post(emu.url + "/v1/responses", json=again) as r:
                got[previous] = (r.status, await r.json())

    run(body, model="m")
    status, whole = got["whole"]
    assert status == 200 and _keys(whole) == _keys(vllm_whole)
    assert whole["status"] == "incomplete" and whole["usage"]["output_tokens"] == 4
    assert whole["usage"]["input_tokens"] > 30
    status, content_type, text = got["stream"]
    events = _events(text)
    assert status == 200 and content_type.startswith("text/event-stream")
    assert _kinds(events) == _kinds(vllm_stream)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert sum(kind == "response.output_text.delta" for kind, _ in events) == 5
    for (kind, ours), (theirs_kind, theirs) in zip(
        (e for e in events if e[0] != "response.output_text.delta"),
        (e for e in vllm_stream if e[0] != "response.output_text.delta"),
        strict=True,
    ):
        assert kind == theirs_kind and _keys(ours) == _keys(theirs), kind
    assert got[whole["id"]][0] == 200 and got[whole["id"]][1]["previous_response_id"] == whole["id"]
    status, error = got["resp_nope"]
    assert status == 404 and error["error"]["message"] == "Response with id 'resp_nope' not found."
