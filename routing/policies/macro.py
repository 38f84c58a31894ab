"""EcoServe macro instances and mitosis scaling (arXiv 2504.18154 §4.2.4), on instance ids only.

A macro instance is a cyclic order of colocated instances of which one is *active*: it takes
new prefills (its prefill phase) while the others only decode. ``Macros`` keeps the grouping
and applies fleet changes the way EcoServe's mitosis does:

* growth: a new instance joins the first macro instance below ``max_size``, right after its
  active member (so it is the next to be activated: a fresh instance is the best place for
  prefills). When every macro instance is full, it joins the last one, which then exceeds
  ``max_size`` and splits: ``min_size`` of its members (the ones furthest from activation)
  form a new macro instance.
* shrink: the removed member leaves its macro instance (an active one hands over to the
  next member). A macro instance below ``min_size`` merges with its smallest neighbour when
  the two fit in ``max_size``; otherwise it takes one member from the largest other.
  After a removal, a macro instance merges with its smallest neighbour whenever the two
  fit in ``max_size`` (EcoServe's Figure 7: merge once two macro instances fit in one).

Requests are never here: the Conductor's books hold them, and regrouping only changes which
instance takes the *next* prefills, so no in-flight request is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Macro:
    members: list[str]
    active: str
    switch_s: float  # when ``active`` started its prefill phase
    # Prefills routed to ``active`` since ``switch_s`` (request id -> arrival), its window.
    window: dict[str, float] = field(default_factory=dict)

    def next_after(self, iid: str) -> str:
        i = self.members.index(iid)
        return self.members[(i + 1) % len(self.members)]

    def activate(self, iid: str, now: float) -> None:
        """Phase switch: ``iid`` starts taking prefills, the previous active only decodes."""
        if iid != self.active:
            self.active = iid
            self.switch_s = now
            self.window = {}


class Macros:
    """The macro instances of one pool; ``phase_since`` says when each member's phase began."""

    def __init__(self, size: int, min_size: int, max_size: int) -> None:
        self.size, self.min_size, self.max_size = size, min_size, max_size
        self.groups: list[Macro] = []
        self.phase_since: dict[str, float] = {}

    # ------------------------------------------------------------------ queries
    def members(self) -> list[str]:
        return [m for g in self.groups for m in g.members]

    def macro_of(self, iid: str) -> Macro | None:
        for g in self.groups:
            if iid in g.members:
                return g
        return None

    # ------------------------------------------------------------------ changes
    def layout(self, ids: list[str], now: float) -> None:
        """Group from scratch: ceil(n / size) macro instances of near-equal size, in order."""
        self.groups = []
        n = len(ids)
        if n == 0:
            return
        k = -(-n // self.size)
        start = 0
        for j in range(k):
            end = start + n // k + (1 if j < n % k else 0)
            part = ids[start:end]
            self.groups.append(Macro(list(part), part[0], now))
            start = end
        self.phase_since = dict.fromkeys(ids, now)

    def sync(self, ids: list[str], now: float) -> None:
        """Apply the difference between the known members and ``ids`` (mitosis)."""
        known = set(self.members())
        wanted = set(ids)
        for iid in [m for m in self.members() if m not in wanted]:
            self._remove(iid, now)
        for iid in ids:
            if iid not in known:
                self._add(iid, now)

    def switch(self, g: Macro, iid: str, now: float) -> None:
        if iid != g.active:
            self.phase_since[g.active] = now
            self.phase_since[iid] = now
            g.activate(iid, now)

    def _add(self, iid: str, now: float) -> None:
        self.phase_since[iid] = now
        if not self.groups:
            self.groups.append(Macro([iid], iid, now))
            return
        g = next((g for g in self.groups if len(g.members) < self.max_size), self.groups[-1])
        g.members.insert(g.members.index(g.active) + 1, iid)
        if len(g.members) > self.max_size:
            self._split(g, now)

    def _split(self, g: Macro, now: float) -> None:
        # The members furthest from activation (the end of the cycle after the active one)
        # leave: they have been decoding longest, so they carry the most saved TPOT slack.
        i = g.members.index(g.active)
        order = g.members[i:] + g.members[:i]
        leaving = order[len(order) - self.min_size :]
        g.members = [m for m in g.members if m not in leaving]
        new = Macro(leaving, leaving[0], now)
        self.phase_since[leaving[0]] = now
        self.groups.insert(self.groups.index(g) + 1, new)

    def _remove(self, iid: str, now: float) -> None:
        g = self.macro_of(iid)
        if g is None:
            return
        self.phase_since.pop(iid, None)
        if len(g.members) == 1:
            self.groups.remove(g)
            return
        if g.active == iid:
            nxt = g.next_after(iid)
            g.members.remove(iid)
            g.active = ""  # force the switch bookkeeping below
            g.activate(nxt, now)
            self.phase_since[nxt] = now
        else:
            g.members.remove(iid)
        self._rebalance(g, now)

    def _rebalance(self, g: Macro, now: float) -> None:
        others = [o for o in self.groups if o is not g]
        if not others:
            return
        smallest = min(others, key=lambda o: len(o.members))
        if len(g.members) + len(smallest.members) <= self.max_size:
            self._merge(g, smallest, now)
        elif len(g.members) < self.min_size:
            # Too small to run a useful cycle and too big to merge: borrow a member (not the
            # active one) from the largest macro instance.
            donor = max(others, key=lambda o: len(o.members))
            moved = next(m for m in reversed(donor.members) if m != donor.active)
            donor.members.remove(moved)
            g.members.append(moved)

    def _merge(self, a: Macro, b: Macro, now: float) -> None:
        # Keep the earlier one (stable order for the admin view); its active member stays
        # active, the other's active member finishes its window and then only decodes.
        first, second = (a, b) if self.groups.index(a) < self.groups.index(b) else (b, a)
        first.members.extend(second.members)
        self.groups.remove(second)
        self.phase_since[second.active] = now
