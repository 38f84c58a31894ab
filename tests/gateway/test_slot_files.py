"""llama.cpp slot files (gateway/slot_files.py) against a fake llama-server's slot API (an
aiohttp server on 127.0.0.1) and a real Conductor: what is saved when, what enters and leaves
the store tier, what is restored before a request, the bound on files, and failures."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.legs import Target
from backends.llamacpp_slot_index import sidecar_name, slot_file_name
from gateway.slot_files import SlotFiles
from routing.conductor import Conductor
from routing.llamacpp_slots import SlotState
from routing.types import Tier
from tests.routing.fleet import fleet_settings

A = (11, 12, 13, 14)
B = (21, 22, 23, 24)


@dataclass
class FakeSlotApi:
    """``POST /slots/{id}?action=save|restore`` as llama-server answers them; writes the file
    on save so that deletions can be checked; ``fail`` answers 500, ``status`` any status."""

    directory: Path
    calls: list[tuple[str, int, str]] = field(default_factory=list)
    fail: bool = False
    status: int = 200

    async def slots(self, request: web.Request) -> web.Response:
        action, slot = request.query["action"], int(request.match_info["slot"])
        name = (await request.json())["filename"]
        self.calls.append((action, slot, name))
        if self.fail or self.status != 200:
            status = 500 if self.fail else self.status
            return web.json_response({"error": {"message": "boom"}}, status=status)
        if action == "save":
            (self.directory / name).write_bytes(b"kv")
            return web.json_response({"n_saved": 64, "n_written": 2, "timings": {"save_ms": 1}})
        return web.json_response({"n_restored": 64, "n_read": 2, "timings": {"restore_ms": 1}})


@dataclass
class Harness:
    files: SlotFiles
    api: FakeSlotApi
    conductor: Conductor
    counts: dict[str, int]

    async def settle(self) -> None:
        """Until the saves (background tasks) are done."""
        for _ in range(100):
            if not self.files._tasks:
                return
            await asyncio.sleep(0.01)


@asynccontextmanager
async def _files(tmp_path: Path, max_files: int = 8) -> AsyncIterator[Harness]:
    api = FakeSlotApi(tmp_path)
    app = web.Application()
    app.router.add_post("/slots/{slot}", api.slots)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    conductor = Conductor(fleet_settings(prefill=0, decode=0, colocated=2))
    counts: dict[str, int] = {}
    async with aiohttp.ClientSession() as session:
        url = str(server.make_url("")).rstrip("/")
        targets = {i: Target(i, url) for i in ("c0", "c1")}
        files = SlotFiles(
            str(tmp_path),
            max_files,
            1,
            conductor,
            targets,
            lambda: session,
            lambda e: counts.__setitem__(e, counts.get(e, 0) + 1),
        )
        try:
            yield Harness(files, api, conductor, counts)
        finally:
            await files.close()
            await server.close()


def _shared(blocks: tuple[int, ...], shared: int, active: int = 0) -> SlotState:
    return SlotState(blocks=blocks, shared=shared, active=active)


def test_a_shared_prefix_is_saved_once_and_enters_the_store_tier(tmp_path: Path) -> None:
    async def run() -> None:
        async with _files(tmp_path) as h:
            files, api = h.files, h.api
            files.slot_released("c0", 1, _shared((*A, 99), 4))
            await h.settle()
            files.slot_released("c1", 0, _shared((*A, 98), 4))  # the same prefix elsewhere
            await h.settle()
            assert api.calls == [("save", 1, slot_file_name(A[-1]))]
            c = h.conductor
            assert all(c.index.holds("", h, Tier.STORE) for h in A)
            assert not c.index.holds("", 99, Tier.STORE)  # the tail is no shared prefix
            assert A[-1] in c.slots.stored
            assert c.index.match((*A, 50), 0.0).store_blocks == 4

    asyncio.run(run())


def test_nothing_is_saved_for_a_one_off_or_a_slot_another_request_waits_for(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        async with _files(tmp_path) as h:
            files, api = h.files, h.api
            files.slot_released("c0", 0, _shared((*A, 99), 0))  # never reused
            files.slot_released("c0", 1, _shared((*B, 99), 4, active=1))  # about to change
            await h.settle()
            assert api.calls == []

    asyncio.run(run())


def test_a_request_pinned_to_a_slot_without_the_prefix_restores_it_first(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        async with _files(tmp_path) as h:
            files, api = h.files, h.api
            files.slot_released("c0", 0, _shared((*A, 99), 4))
            await h.settle()
            files.plan_restore("r1", "c1", 1, (*A, 7, 8), matched=0)
            files.plan_restore("r2", "c0", 0, (*A, 9), matched=4)  # the slot holds A already
            files.plan_restore("r3", "c0", 1, (*B, 9), matched=0)  # nothing saved for B
            for rid in ("r1", "r2", "r3"):
                await files.restore_before(rid)
            assert api.calls[1:] == [("restore", 1, slot_file_name(A[-1]))]
            assert h.counts == {"saved": 1, "restored": 1}
            assert [files.restored_blocks(r) for r in ("r1", "r2", "r1")] == [4, 0, 0]

    asyncio.run(run())


def test_one_file_per_prompt_the_longest_shared_prefix(tmp_path: Path) -> None:
    """A slot whose shared prefix grew (a second request shared a block more) is saved again
    and the shorter file goes; a shorter prefix a file already holds is not saved."""

    async def run() -> None:
        async with _files(tmp_path) as h:
            files, api = h.files, h.api
            files.slot_released("c0", 0, _shared((*A, 99), 3))
            await h.settle()
            files.slot_released("c0", 0, _shared((*A, 99), 4))
            await h.settle()
            files.slot_released("c1", 1, _shared((*A, 98), 3))  # held by A's file
            await h.settle()
            assert [c[2] for c in api.calls] == [slot_file_name(A[2]), slot_file_name(A[3])]
            assert list(files.saved) == [A[-1]]
            assert h.counts == {"saved": 2, "deleted": 1}
            name = slot_file_name(A[-1])
            assert sorted(p.name for p in tmp_path.iterdir()) == [name, sidecar_name(name)]
            assert all(h.conductor.index.holds("", k, Tier.STORE) for k in A)
            # a slot holding A[:3] costs nothing to overwrite: A's file holds it
            assert set(A) <= h.conductor.slots.stored

    asyncio.run(run())


def test_a_file_that_shares_part_of_the_prompt_is_loaded_for_that_part(tmp_path: Path) -> None:
    """The engine reuses the common prefix of the file's tokens and the prompt's: a file of
    A + a user turn serves a prompt of A + another turn."""

    async def run() -> None:
        async with _files(tmp_path) as h:
            files = h.files
            files.slot_released("c0", 0, _shared((*A, 99), 4))
            await h.settle()
            files.plan_restore("r", "c1", 0, (A[0], A[1], A[2], 70, 71), matched=0)
            files.plan_restore("q", "c1", 1, (A[0], A[1], A[2], 70), matched=3)  # no gain
            await files.restore_before("r")
            await files.restore_before("q")
            assert [c[:2] for c in h.api.calls[1:]] == [("restore", 0)]
            assert files.restored_blocks("r") == 3

    asyncio.run(run())


def test_beyond_the_bound_the_least_recently_used_file_is_deleted(tmp_path: Path) -> None:
    async def run() -> None:
        async with _files(tmp_path, max_files=1) as h:
            files = h.files
            files.slot_released("c0", 0, _shared((*A, 99), 4))
            await h.settle()
            files.slot_released("c0", 1, _shared((*B, 99), 4))
            await h.settle()
            c = h.conductor
            assert list(files.saved) == [B[-1]]
            name = slot_file_name(B[-1])
            assert sorted(p.name for p in tmp_path.iterdir()) == [name, sidecar_name(name)]
            assert not any(c.index.holds("", h, Tier.STORE) for h in A)
            assert A[-1] not in c.slots.stored and B[-1] in c.slots.stored

    asyncio.run(run())


def test_a_failed_save_or_restore_changes_nothing_but_a_counter(tmp_path: Path) -> None:
    async def run() -> None:
        async with _files(tmp_path) as h:
            files, api = h.files, h.api
            files.slot_released("c0", 0, _shared((*A, 99), 4))
            await h.settle()
            api.fail = True
            files.slot_released("c0", 1, _shared((*B, 99), 4))
            await h.settle()
            files.plan_restore("r", "c1", 0, (*A, 1), matched=0)
            await files.restore_before("r")
            c = h.conductor
            assert list(files.saved) == [A[-1]]
            assert not c.index.holds("", B[0], Tier.STORE)
            assert h.counts == {
                "saved": 1,
                "save_failed": 1,
                "restore_failed": 1,
            }

    asyncio.run(run())


@pytest.mark.parametrize("status", [400, 501])
def test_a_file_the_engine_cannot_load_is_dropped(tmp_path: Path, status: int) -> None:
    """400: the file is gone (another replica's bound), corrupt or another model's: it leaves
    the store tier and DIR. 501 (no --slot-save-path on that engine) says nothing of the file."""

    async def run() -> None:
        async with _files(tmp_path) as h:
            h.files.slot_released("c0", 0, _shared((*A, 99), 4))
            await h.settle()
            h.api.status = status
            h.files.plan_restore("r", "c1", 0, (*A, 1), matched=0)
            await h.files.restore_before("r")
            kept = status != 400
            assert (A[-1] in h.files.saved) is kept
            assert h.conductor.index.holds("", A[0], Tier.STORE) is kept
            assert (A[-1] in h.conductor.slots.stored) is kept
            assert any(tmp_path.iterdir()) is kept
            deleted = {} if kept else {"deleted": 1}
            assert h.counts == {"saved": 1, "restore_failed": 1, **deleted}

    asyncio.run(run())


def test_an_engine_that_refused_a_save_is_not_asked_again_for_a_while(tmp_path: Path) -> None:
    """An engine started without --slot-save-path refuses every save: one try, not one per
    request."""

    async def run() -> None:
        async with _files(tmp_path) as h:
            h.api.fail = True
            h.files.slot_released("c0", 0, _shared((*A, 99), 4))
            await h.settle()
            h.files.slot_released("c0", 1, _shared((*B, 99), 4))  # the same engine: skipped
            h.files.slot_released("c1", 0, _shared((*B, 98), 4))  # another engine: tried
            await h.settle()
            assert [(c[0], c[1]) for c in h.api.calls] == [("save", 0), ("save", 0)]
            assert h.counts == {"save_failed": 2}

    asyncio.run(run())


def _age_all(d: Path, seconds: float, names: tuple[str, ...] | None = None) -> None:
    for p in d.iterdir():
        if names is None or p.name in names:
            t = p.stat().st_mtime - seconds
            os.utime(p, (t, t))


def test_a_new_gateway_takes_over_the_files_an_earlier_one_saved(tmp_path: Path) -> None:
    """A restart: the files enter the new gateway's store tier and are loaded for requests
    as if it had saved them, and a taken-over prefix is not saved again."""

    async def run() -> None:
        async with _files(tmp_path) as first:
            first.files.slot_released("c0", 0, _shared((*A, 99), 4))
            first.files.slot_released("c1", 1, _shared((*B, 98), 4))
            await first.settle()
            assert first.counts == {"saved": 2}
        async with _files(tmp_path) as h:
            await h.files.sync()
            assert h.counts == {"adopted": 2}
            assert set(h.files.saved) == {A[-1], B[-1]}
            c = h.conductor
            assert c.index.match((*A, 50), 0.0).store_blocks == 4
            assert A[-1] in c.slots.stored and B[-1] in c.slots.stored
            h.files.plan_restore("r", "c1", 0, (*A, 7), matched=0)
            await h.files.restore_before("r")
            h.files.slot_released("c1", 0, _shared((*A, 7), 4))
            await h.settle()
            assert h.api.calls == [("restore", 0, slot_file_name(A[-1]))]
            assert h.files.restored_blocks("r") == 4

    asyncio.run(run())


def test_taking_over_keeps_the_bound_and_deletes_leftovers(tmp_path: Path) -> None:
    async def run() -> None:
        async with _files(tmp_path) as first:
            first.files.slot_released("c0", 0, _shared((*A, 99), 4))
            await first.settle()
            _age_all(tmp_path, 100)  # A is older than B
            first.files.slot_released("c1", 1, _shared((*B, 98), 4))
            await first.settle()
        leftover = slot_file_name(77)
        (tmp_path / leftover).write_bytes(b"kv")  # no sidecar: cannot be taken over
        young = slot_file_name(78)
        (tmp_path / young).write_bytes(b"kv")  # perhaps another replica's save under way
        _age_all(tmp_path, 1_000, (leftover,))
        async with _files(tmp_path, max_files=1) as h:
            await h.files.sync()
            assert list(h.files.saved) == [B[-1]]
            assert not any(h.conductor.index.holds("", k, Tier.STORE) for k in A)
            assert h.counts == {"adopted": 2, "deleted": 1, "leftover_deleted": 1}
            b = slot_file_name(B[-1])
            assert sorted(p.name for p in tmp_path.iterdir()) == sorted([b, sidecar_name(b), young])

    asyncio.run(run())


def test_replicas_sharing_the_directory_see_each_others_files_come_and_go(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        async with _files(tmp_path, max_files=1) as one, _files(tmp_path) as two:
            one.files.slot_released("c0", 0, _shared((*A, 99), 4))
            await one.settle()
            await two.files.sync()
            assert list(two.files.saved) == [A[-1]]
            one.files.slot_released("c0", 1, _shared((*B, 98), 4))  # one's bound deletes A
            await one.settle()
            await two.files.sync()
            assert list(two.files.saved) == [B[-1]]
            c = two.conductor
            assert not any(c.index.holds("", k, Tier.STORE) for k in A)
            assert all(c.index.holds("", k, Tier.STORE) for k in B)
            assert not set(A) & c.slots.stored
            assert two.counts == {"adopted": 2, "vanished": 1}
            await two.files.sync()  # nothing new: the known sidecars are not read again
            assert two.counts == {"adopted": 2, "vanished": 1}

    asyncio.run(run())


def test_a_save_path_kvgate_cannot_see_is_a_warning_not_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def run() -> None:
        async with _files(tmp_path / "not-here") as h:
            await h.files.sync()
            await h.files.sync()
            assert h.files.saved == {} and h.counts == {}

    asyncio.run(run())
    assert caplog.text.count("cannot list llama.cpp slot save path") == 1  # once, not per scan


def test_file_names_are_plain_hex_of_the_key():
    assert slot_file_name(-1) == "kvgate-ffffffffffffffff.bin"
    assert slot_file_name(255) == "kvgate-00000000000000ff.bin"


@pytest.mark.parametrize("name", ["../etc/passwd", "a b", ""])
def test_an_unsafe_file_name_is_refused_before_any_request(name: str) -> None:
    from backends.llamacpp_slot_api import SlotFileError, save_slot

    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            await save_slot(s, "http://127.0.0.1:9", 0, name, 1.0)

    with pytest.raises(SlotFileError, match="unsafe"):
        asyncio.run(run())
