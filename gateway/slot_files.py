"""llama.cpp slot files: a store tier for shared prefixes (``routing.llamacpp_slot_save_path``).

A llama-server caches one prompt per slot; with eight hot system prompts on six slots the
colder ones are overwritten and recomputed again and again (docs/real-engines.md section 3).
Started with ``--slot-save-path DIR``, llama-server writes a slot's tokens and KV to a file in
DIR and loads it back into any slot on request (backends/llamacpp_slot_api.py), and every
llama-server of the model that shares DIR can load what another saved. kvgate uses that as
the shared store tier of its cache view:

- When kvgate's last request on a slot finishes and the slot's shared prefix (one that served
  two requests, routing/llamacpp_slots.py) has no file yet, the slot is saved, named by the
  prefix's end key; the prefix's blocks enter the store tier (placement may then price a load
  from the store, and overwriting the slot costs no recompute any more). A file that holds
  the prefix and more counts as one; a file of a shorter prefix of it is deleted (one file per
  prompt: Llama-3-8B in fp16 writes 128 KiB of KV per token, and the bound goes further).
- A request pinned to a slot that holds less of its prompt than a saved file shares with it
  has that file restored into the slot first, and finds the common prefix cached. A file the
  engine cannot load (gone, corrupt, another model's: HTTP 400) is dropped and deleted; a
  prefix still hot gets a new one.
- At most ``routing.llamacpp_slot_files_max`` files: beyond it the least recently used is
  deleted from DIR (kvgate must see DIR: one host, or a shared filesystem) and its blocks
  leave the store tier.
- Beside each file kvgate writes the prefix's block keys (backends/llamacpp_slot_index.py); a
  gateway that starts on a DIR with files in it (a restart) takes them over into the store
  tier and the bound, deletes its own leftovers that cannot be, and rescans DIR every
  SYNC_INTERVAL_S (``sync``): gateway replicas sharing DIR see each other's files come and go.

A failed save or restore costs only the recompute it would have saved (counted in
``kvgate_llamacpp_slot_files_total``); the engine compares tokens, so a stale file is harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from backends.background_tasks import BackgroundTasks
from backends.legs import Target
from backends.llamacpp_slot_api import SlotFileError, restore_slot, save_slot
from backends.llamacpp_slot_index import (
    remove_files,
    scan_slot_dir,
    sidecar_name,
    slot_file_name,
    write_sidecar,
)
from backends.stop_wait import wait_or_stop
from routing.conductor import Conductor
from routing.hashing import common_prefix_blocks
from routing.llamacpp_slots import SlotState
from routing.types import BlockRemoved, BlockStored, Tier

log = logging.getLogger(__name__)

SLOT_FILE_TIMEOUT_S = 30.0  # a save or restore waits for a busy slot to free
# After a failed save, that engine is not asked to save again for this long: an engine started
# without --slot-save-path refuses every save, and each request would otherwise try (and log).
SAVE_BACKOFF_S = 60.0
# A slot file without its key sidecar (or the reverse) older than this has no writer left (a
# save's sidecar follows its file within milliseconds); younger, it may be a replica's save.
ORPHAN_AGE_S = 120.0
# How often DIR is rescanned: gateway replicas sharing it see each other's files within this.
SYNC_INTERVAL_S = 10.0


@dataclass(slots=True)
class _SavedPrefix:
    filename: str
    blocks: tuple[int, ...]  # the shared prefix's block keys, as the store tier holds them


@dataclass(frozen=True, slots=True)
class _Restore:
    instance_id: str
    slot: int
    key: int
    blocks: int  # leading blocks of the prompt the file holds


def _starts_with(blocks: tuple[int, ...], prefix: tuple[int, ...]) -> bool:
    """``blocks`` begins with all of ``prefix``: keys are chained, so one comparison at the
    prefix's end says it."""
    n = len(prefix)
    return 0 < n <= len(blocks) and blocks[n - 1] == prefix[-1]


class SlotFiles:
    def __init__(
        self,
        save_path: str,
        max_files: int,
        min_blocks: int,
        conductor: Conductor,
        targets: Mapping[str, Target],
        session: Callable[[], aiohttp.ClientSession | None],
        count: Callable[[str], None],
    ) -> None:
        self.save_path = save_path
        self.max_files = max_files
        self.min_blocks = max(1, min_blocks)
        self._conductor = conductor
        self._targets = targets
        self._session = session
        self._count = count  # kvgate_llamacpp_slot_files_total{event}
        self.saved: OrderedDict[int, _SavedPrefix] = OrderedDict()  # end key -> file, LRU first
        self._saving: set[int] = set()
        self._no_saves_until: dict[str, float] = {}  # instance -> loop time (SAVE_BACKOFF_S)
        self._restores: dict[str, _Restore] = {}  # request id -> the file to load first
        self._restored: dict[str, int] = {}  # request id -> prompt blocks a file brought in
        self._tasks = BackgroundTasks()
        self._unlistable = False  # DIR could not be listed last time (warned once)

    # ---- saving ----
    def slot_released(self, instance_id: str, slot: int, state: SlotState) -> None:
        """kvgate's request on ``slot`` finished: save the slot's shared prefix if no file
        holds it and no other request of kvgate's waits for the slot (it would overwrite the
        slot before the save ran)."""
        n = min(state.shared, len(state.blocks))
        if state.active or n < self.min_blocks:
            return
        key = state.blocks[n - 1]
        covering = self._covering(n, key)
        if covering is not None:  # a file holds this prefix already (and perhaps more)
            self.saved.move_to_end(covering)
            return
        if key in self._saving:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a synchronous caller): nothing to save with
            return
        if self._no_saves_until.get(instance_id, 0.0) > loop.time():
            return
        self._saving.add(key)
        self._tasks.spawn(self._save(instance_id, slot, key, state.blocks[:n]))

    async def _save(self, instance_id: str, slot: int, key: int, blocks: tuple[int, ...]) -> None:
        target, session = self._targets.get(instance_id), self._session()
        try:
            if target is None or session is None:
                return
            name = slot_file_name(key)
            await save_slot(session, target.url, slot, name, SLOT_FILE_TIMEOUT_S)
        except SlotFileError as exc:
            log.warning(
                "llama.cpp slot save on %s failed (no saves there for %g s; was it started "
                "with --slot-save-path %s?): %s",
                instance_id,
                SAVE_BACKOFF_S,
                self.save_path,
                exc,
            )
            self._no_saves_until[instance_id] = asyncio.get_running_loop().time() + SAVE_BACKOFF_S
            self._count("save_failed")
            return
        finally:
            self._saving.discard(key)
        try:
            await asyncio.to_thread(write_sidecar, self.save_path, name, blocks)
        except OSError as exc:  # the file serves this run; a restart will not take it over
            log.warning("could not write the key sidecar of llama.cpp slot file %s: %s", name, exc)
        self.saved[key] = _SavedPrefix(name, blocks)
        self._conductor.store_changed(BlockStored(blocks, Tier.STORE))
        self._count("saved")
        for shorter in [
            k for k, f in self.saved.items() if k != key and _starts_with(blocks, f.blocks)
        ]:
            await self._drop(shorter)  # the new file serves every prompt the shorter one did
        await self._bound()

    def _covering(self, n: int, end_key: int) -> int | None:
        """A saved file whose prefix starts with the ``n`` blocks ending with ``end_key``
        (chained keys: one comparison per file, no copy of the prompt's blocks)."""
        for k, f in self.saved.items():
            if len(f.blocks) >= n and f.blocks[n - 1] == end_key:
                return k
        return None

    async def _bound(self) -> None:
        """Delete the least recently used files beyond ``max_files``."""
        while len(self.saved) > self.max_files:
            await self._drop(next(iter(self.saved)))

    def _forget(self, key: int) -> _SavedPrefix | None:
        """The file leaves the store tier (its blocks no other file holds)."""
        old = self.saved.pop(key, None)
        if old is not None:
            kept = {h for f in self.saved.values() for h in f.blocks}
            gone = tuple(h for h in old.blocks if h not in kept)
            self._conductor.store_changed(BlockRemoved(gone, Tier.STORE))
        return old

    async def _drop(self, key: int) -> None:
        """The file leaves the store tier and DIR (a prefix still hot is saved again)."""
        old = self._forget(key)
        if old is None:
            return
        if await self._delete((old.filename, sidecar_name(old.filename))):
            self._count("deleted")
        else:
            self._count("delete_failed")

    async def _delete(self, names: tuple[str, ...]) -> bool:
        try:
            await asyncio.to_thread(remove_files, self.save_path, names)
        except OSError as exc:
            log.warning("could not delete %s in %s: %s", ", ".join(names), self.save_path, exc)
            return False
        return True

    # ---- the directory as it is: an earlier run's files, other replicas' ----
    async def sync(self) -> None:
        """Bring the store tier in line with DIR: take over the files found there (an
        earlier run's, another replica's) whose key sidecar is valid, least recently written
        first; forget files gone from it (another replica's bound); delete kvgate's leftovers
        that cannot be taken over; then apply the bound. At start, then every SYNC_INTERVAL_S."""
        before = dict(self.saved)  # saves that finish during the scan are not in it
        known = frozenset(f.filename for f in before.values())
        try:
            found = await asyncio.to_thread(scan_slot_dir, self.save_path, ORPHAN_AGE_S, known)
        except OSError as exc:
            if not self._unlistable:
                log.warning(
                    "cannot list llama.cpp slot save path %s (kvgate must see it to bound and "
                    "reuse slot files): %s",
                    self.save_path,
                    exc,
                )
            self._unlistable = True
            return
        self._unlistable = False
        if found.orphans and await self._delete(found.orphans):
            for _ in found.orphans:
                self._count("leftover_deleted")
        vanished = [
            k
            for k, f in before.items()
            if f.filename not in found.present and self.saved.get(k) is f
        ]
        for key in vanished:
            self._forget(key)
            self._count("vanished")
        for f in found.files:
            if f.key in self.saved:
                continue
            self.saved[f.key] = _SavedPrefix(f.filename, f.blocks)
            self._conductor.store_changed(BlockStored(f.blocks, Tier.STORE))
            self._count("adopted")
        if found.files or found.orphans or vanished:
            log.info(
                "llama.cpp slot files in %s: %d taken over, %d gone, %d leftovers deleted",
                self.save_path,
                len(found.files),
                len(vanished),
                len(found.orphans),
            )
        await self._bound()

    async def run(self, stop: asyncio.Event) -> None:
        """``sync`` every SYNC_INTERVAL_S until ``stop``."""
        while not await wait_or_stop(stop, SYNC_INTERVAL_S):
            try:
                await self.sync()
            except Exception:  # one bad round must not end the rescans
                log.exception("llama.cpp slot files: rescanning %s failed", self.save_path)

    # ---- restoring ----
    def plan_restore(
        self, request_id: str, instance_id: str, slot: int, blocks: Sequence[int], matched: int
    ) -> None:
        """The request was pinned to ``slot``, which holds ``matched`` leading blocks of it:
        if a file shares more of the prompt, load it before the request goes out (the engine
        then reuses the common prefix of the file's tokens and the prompt's). Each file (at
        most ``max_files``) is compared by a bisection of chained keys, not block by block."""
        best = matched + self.min_blocks - 1  # a file must bring at least min_blocks more
        key = None
        for k, f in self.saved.items():
            n = common_prefix_blocks(blocks, f.blocks)
            if n > best:
                best, key = n, k
        if key is not None:
            self._restores[request_id] = _Restore(instance_id, slot, key, best)

    async def restore_before(self, request_id: str) -> None:
        """Load the file planned for this request into its slot (nothing if none was)."""
        plan = self._restores.pop(request_id, None)
        if plan is None:
            return
        saved = self.saved.get(plan.key)
        target, session = self._targets.get(plan.instance_id), self._session()
        if saved is None or target is None or session is None:
            return
        try:
            await restore_slot(session, target.url, plan.slot, saved.filename, SLOT_FILE_TIMEOUT_S)
        except SlotFileError as exc:
            log.warning("llama.cpp slot restore on %s failed: %s", plan.instance_id, exc)
            self._count("restore_failed")
            if exc.bad_file:  # gone (another replica's bound), corrupt, another model's
                await self._drop(plan.key)
            return
        if plan.key in self.saved:
            self.saved.move_to_end(plan.key)
        self._restored[request_id] = plan.blocks
        self._count("restored")

    def restored_blocks(self, request_id: str) -> int:
        """Leading blocks of the request's prompt a file loaded into its slot (asked once)."""
        return self._restored.pop(request_id, 0)

    def forget(self, request_id: str) -> None:
        """The request is done, or will not go out."""
        self._restores.pop(request_id, None)
        self._restored.pop(request_id, None)

    async def close(self) -> None:
        await self._tasks.cancel_all()
