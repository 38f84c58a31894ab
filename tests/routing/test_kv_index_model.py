"""KVIndex against a deliberately naive reference model (hypothesis): every match equals the
model's, memory stays bounded over long random operation sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.kv_index import KVIndex
from routing.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    PrefixMatch,
    Tier,
)

# --- a deliberately naive reference model (lists, per-instance scans) -----------------------


@dataclass
class _RefInst:
    cap: int
    hcap: int
    gpu: list[int] = field(default_factory=list)  # LRU first
    host: list[int] = field(default_factory=list)
    pred: dict[int, float] = field(default_factory=dict)


def _to_end(lst: list[int], h: int) -> None:
    if h in lst:
        lst.remove(h)
    lst.append(h)


class RefIndex:
    """Same documented semantics as KVIndex, written for clarity instead of speed."""

    def __init__(self, ttl: float | None) -> None:
        self.ttl = ttl
        self.inst: dict[str, _RefInst] = {}  # registration order
        self.store: set[int] = set()
        self.unknown = 0

    def _purge(self, now: float) -> None:
        for i in self.inst.values():
            for h, exp in list(i.pred.items()):
                if exp <= now:
                    del i.pred[h]
                    for lst in (i.gpu, i.host):
                        if h in lst:
                            lst.remove(h)

    def _evict(self, i: _RefInst) -> None:
        while len(i.gpu) > i.cap:
            h = i.gpu.pop(0)
            if i.hcap:
                _to_end(i.host, h)
            elif h not in i.host:
                i.pred.pop(h, None)
        while len(i.host) > i.hcap:
            h = i.host.pop(0)
            if h not in i.gpu:
                i.pred.pop(h, None)

    def route(self, iid: str, blocks: list[int], now: float) -> None:
        self._purge(now)
        i = self.inst.get(iid)
        if i is None:
            return
        for h in reversed(blocks):  # prefix ends up most recent
            if h in i.gpu:
                _to_end(i.gpu, h)
                continue
            i.gpu.append(h)
            if h in i.host:
                _to_end(i.host, h)
            elif self.ttl is not None:
                i.pred[h] = now + self.ttl
        self._evict(i)

    def touch(self, iid: str, blocks: list[int]) -> None:
        i = self.inst.get(iid)
        if i is None:
            return
        for h in reversed(blocks):
            for lst in (i.gpu, i.host):
                if h in lst:
                    _to_end(lst, h)

    def apply(self, iid: str, ev: KVEvent, now: float) -> None:
        i = self.inst.get(iid)
        if i is None:
            self.unknown += 1
            return
        self._purge(now)
        if isinstance(ev, AllBlocksCleared):
            i.gpu.clear()
            i.host.clear()
            i.pred.clear()
            return
        if ev.tier is Tier.STORE:
            self.apply_store(ev)
            return
        if isinstance(ev, BlockStored):
            for h in reversed(ev.block_hashes):
                if ev.tier is Tier.GPU:
                    if h in i.gpu:
                        _to_end(i.gpu, h)
                    else:
                        i.gpu.append(h)
                        if h in i.host:
                            _to_end(i.host, h)
                else:
                    _to_end(i.host, h)
            for h in ev.block_hashes:
                i.pred.pop(h, None)
            self._evict(i)
        else:
            lst = i.gpu if ev.tier is Tier.GPU else i.host
            for h in ev.block_hashes:
                if h in lst:
                    lst.remove(h)
                    if h not in i.gpu and h not in i.host:
                        i.pred.pop(h, None)

    def apply_store(self, ev: KVEvent) -> None:
        if isinstance(ev, BlockStored):
            self.store.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            self.store.difference_update(ev.block_hashes)
        else:
            self.store.clear()

    def match(self, blocks: list[int], now: float) -> PrefixMatch:
        self._purge(now)

        def lead(held: set[int]) -> int:
            n = 0
            for h in blocks:
                if h not in held:
                    break
                n += 1
            return n

        gpu = {iid: lead(set(i.gpu)) for iid, i in self.inst.items()}
        loc = {iid: lead(set(i.gpu) | set(i.host)) for iid, i in self.inst.items()}
        best = max(loc.values(), default=0)
        return PrefixMatch(
            {k: v for k, v in gpu.items() if v},
            {k: v for k, v in loc.items() if v},
            lead(self.store),
            best,
            tuple(k for k, v in loc.items() if v == best) if best else (),
        )

    def blocks(self) -> set[int]:
        out = set(self.store)
        for i in self.inst.values():
            out.update(i.gpu, i.host)
        return out


# --- random operation sequences --------------------------------------------------------------

IDS = ["a", "b", "c", "d"]  # a, b, c start registered; d only if an "add" op registers it
DOCS = 3


def _prompt(doc: int, length: int) -> list[int]:
    # Documents share their first 2 blocks (a common "system prompt"), then diverge.
    return [1000 + j if j < 2 else 100 * doc + j for j in range(length)]


prompt_st = st.builds(_prompt, st.integers(0, DOCS - 1), st.integers(0, 7))
blocks_st = st.one_of(prompt_st, st.lists(st.sampled_from([1000, 1001, 2, 3, 102, 205, 7])))
dt_st = st.sampled_from([0.0, 0.5, 1.0, 2.0])
tier_st = st.sampled_from([Tier.GPU, Tier.GPU, Tier.HOST, Tier.STORE])
id_st = st.sampled_from(IDS)
caps_st = st.tuples(st.integers(0, 6), st.sampled_from([0, 0, 2, 4]))

op_st = st.one_of(
    st.tuples(st.just("route"), id_st, prompt_st, dt_st),
    st.tuples(st.just("route"), id_st, prompt_st, dt_st),
    st.tuples(st.just("touch"), id_st, prompt_st),
    st.tuples(st.just("stored"), id_st, blocks_st, tier_st, dt_st),
    st.tuples(st.just("removed"), id_st, blocks_st, tier_st, dt_st),
    st.tuples(st.just("cleared"), id_st, dt_st),
    st.tuples(st.just("store"), st.sampled_from(["stored", "removed", "cleared"]), blocks_st),
    st.tuples(st.just("add"), id_st, caps_st),
    st.tuples(st.just("remove"), id_st),
    st.tuples(st.just("expire"), dt_st),
)


def _run(
    ops: list[tuple],
    ttl: float | None,
    initial: list[tuple[int, int]],
    check_each: bool = True,
) -> None:
    idx, ref = KVIndex(predicted_ttl_s=ttl), RefIndex(ttl)
    for iid, (cap, hcap) in zip(IDS, initial, strict=False):
        idx.add_instance(iid, cap, hcap)
        ref.inst[iid] = _RefInst(cap, hcap)
    now = 0.0
    probes = [_prompt(d, 8) for d in range(DOCS)] + [[1000, 1001, 2, 3, 102, 205, 7]]
    for op in ops:
        kind = op[0]
        if kind == "route":
            now += op[3]
            idx.record_route(op[1], op[2], now)
            ref.route(op[1], op[2], now)
        elif kind == "touch":
            idx.touch(op[1], op[2])
            ref.touch(op[1], op[2])
        elif kind in ("stored", "removed"):
            now += op[4]
            cls = BlockStored if kind == "stored" else BlockRemoved
            ev = cls(tuple(op[2]), op[3])
            idx.apply(op[1], ev, now)
            ref.apply(op[1], ev, now)
        elif kind == "cleared":
            now += op[2]
            idx.apply(op[1], AllBlocksCleared(), now)
            ref.apply(op[1], AllBlocksCleared(), now)
        elif kind == "store":
            sev: KVEvent = {
                "stored": BlockStored(tuple(op[2]), Tier.STORE),
                "removed": BlockRemoved(tuple(op[2]), Tier.STORE),
                "cleared": AllBlocksCleared(),
            }[op[1]]
            idx.apply_store(sev)
            ref.apply_store(sev)
        elif kind == "add":
            cap, hcap = op[2]
            if op[1] in ref.inst:
                with pytest.raises(ValueError):
                    idx.add_instance(op[1], cap, hcap)
            else:
                idx.add_instance(op[1], cap, hcap)
                ref.inst[op[1]] = _RefInst(cap, hcap)
        elif kind == "remove":
            if op[1] in ref.inst:
                idx.remove_instance(op[1])
                del ref.inst[op[1]]
            else:
                with pytest.raises(KeyError):
                    idx.remove_instance(op[1])
        elif kind == "expire":
            now += op[1]
            idx.expire(now)
            ref._purge(now)
        if check_each:
            _check(idx, ref, probes, now)
    _check(idx, ref, probes, now)


def _check(idx: KVIndex, ref: RefIndex, probes: list[list[int]], now: float) -> None:
    for p in probes:
        for k in (len(p), 3, 1):
            assert idx.match(p[:k], now) == ref.match(p[:k], now), (p[:k], now)
    assert idx.instances() == tuple(ref.inst)
    assert idx.unknown_instance_events == ref.unknown
    for iid, r in ref.inst.items():
        # LRU order is part of the contract (it decides evictions): compare it exactly.
        inst = idx._instances[iid]
        assert list(inst.gpu) == r.gpu, iid
        assert list(inst.host) == r.host, iid
        assert set(inst.pred) == set(r.pred), iid
        assert idx.blocks_held(iid) == (len(r.gpu), len(r.host))
        # Memory bound per instance.
        assert len(r.gpu) <= r.cap and len(r.host) <= r.hcap
        for h in r.gpu:
            assert idx.holds(iid, h, Tier.GPU) and idx.holds(iid, h)
    # The block table holds exactly the blocks somebody holds: bounded by the capacities.
    assert len(idx) == len(ref.blocks())
    assert len(idx) <= sum(r.cap + r.hcap for r in ref.inst.values()) + len(ref.store)


ttl_st = st.sampled_from([None, 1.0, 2.5])
initial_st = st.lists(caps_st, min_size=3, max_size=3)


@settings(max_examples=500, deadline=None)
@given(ops=st.lists(op_st, max_size=40), ttl=ttl_st, initial=initial_st)
def test_property_matches_reference_model(
    ops: list[tuple], ttl: float | None, initial: list[tuple[int, int]]
) -> None:
    _run(ops, ttl, initial)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(op_st, min_size=100, max_size=200), ttl=ttl_st, initial=initial_st)
def test_property_long_sequences_stay_bounded(
    ops: list[tuple], ttl: float | None, initial: list[tuple[int, int]]
) -> None:
    _run(ops, ttl, initial, check_each=False)


# --- targeted behaviour ----------------------------------------------------------------------
