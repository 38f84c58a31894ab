"""EcoServe's rolling activation (arXiv 2504.18154, Algorithms 1-2) for colocated pools.

Partially disaggregated serving: each instance of a macro instance (``macro.Macros``) is in
its *prefill phase* while it is the macro instance's active member and in its *decode phase*
otherwise, so the gateway, not the engine, separates the phases in time. New prefills go only
to active members; the windows roll through the cycle so some instance always takes prefills.

InterSchedule (Algorithm 1): stay on the active member while CheckConstraints holds, else move
to the next member of the cycle (a phase switch). Across macro instances (EcoServe's overall
scheduler) the active members are tried least-loaded first, then the phase switches; when no
instance passes, the least-violating one is taken and admission decides.

CheckConstraints (Algorithm 2), with kvgate's predictors and the Conductor's books:

1. TTFT: every prefill routed to the instance since its phase switch (its *window*) and this
   one finish within the TTFT SLO (or ``max_window_s``). The engine runs the queue FCFS in
   chunked mixed steps, so a finish is the books' estimate plus each chunk step's decode part.
2. TPOT: no saveable decode is pushed past its TPOT SLO by the prefill work ahead of it. A
   decode with ``g`` tokens in ``e`` seconds since its first token and ``r`` predicted tokens
   left ends with slack ``g * SLO - e + slack_credit * r * (SLO - t)`` (``t``: decode-only TBT).
   ``s`` mixed chunk steps of total duration ``P`` each still yield a token, so they cost
   ``P + s * (decode_part - SLO)``. Running decodes stall for the whole queue plus this
   prefill; the decodes the queued prefills will create (colocated) for what follows them.
   EcoServe takes the *mean* saved slack of the decodes older than the switch and credits no
   future slack, because its engine starts a window's requests decoding only after the window;
   vLLM/SGLang decode them at once inside the window's mixed steps, so they are protected here
   too (``tpot_quantile``/``slack_credit`` tune the rule; docs/ecoserve.md discusses it).
3. KV capacity: reserved tokens + this prompt + its predicted output fit, and a batch slot.

The policy keeps only routing state (the grouping, active members, windows); requests live in
the Conductor's books, so regrouping (mitosis) never touches an in-flight request.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from config.settings import AdmissionMode, Role
from routing.estimates import PrefillOption
from routing.instance_books import InstanceState
from routing.policies.base import PlacementContext, PolicyBase, min_queue
from routing.policies.macro import Macro, Macros
from routing.prefill_stall import decode_part_s, running_slack

# SLOs used when the Conductor gives none (EcoServe Table 4, ShareGPT): TTFT 5 s, TPOT 100 ms.
DEFAULT_TTFT_SLO_S = 5.0
DEFAULT_TPOT_SLO_S = 0.1


@dataclass(slots=True)
class Check:
    """One CheckConstraints answer; ``failed`` is the first constraint that failed."""

    option: PrefillOption
    failed: str | None  # None | "ttft" | "tpot" | "kv"
    score: float  # how far past the constraints (0 when it passes)
    ttft_s: float  # worst predicted TTFT in the window with this request
    tpot_headroom_s: float | None  # slack left after the stall (None: no decode to protect)


class RollingActivationPolicy(PolicyBase):
    name: ClassVar[str] = "rolling_activation"
    native_admission: ClassVar[AdmissionMode] = AdmissionMode.NONE

    def __init__(
        self,
        macro_size: int = 4,
        min_macro: int = 2,
        max_macro: int = 6,
        ttft_margin: float = 1.0,
        tpot_margin: float = 1.0,
        chunk_tokens: int = 0,
        tpot_quantile: float = 0.0,
        slack_credit: float = 0.5,
        max_window_s: float = 0.0,
    ) -> None:
        """``macro_size``: instances per macro instance at start; ``min_macro``/``max_macro``:
        mitosis bounds. Predicted TTFT and TPOT stall are multiplied by the margins (> 1 ends
        windows earlier). ``chunk_tokens``: the engines' chunked-prefill budget (0 = the
        profile's ``max_batched_tokens``, vLLM's default)."""
        if not 1 <= min_macro <= macro_size <= max_macro:
            raise ValueError("need 1 <= min_macro <= macro_size <= max_macro")
        if max_macro < 2 * min_macro - 1:
            raise ValueError("need max_macro >= 2 * min_macro - 1 so that a split fits")
        if ttft_margin <= 0 or tpot_margin <= 0 or chunk_tokens < 0:
            raise ValueError("margins must be > 0 and chunk_tokens >= 0")
        if not 0.0 <= tpot_quantile <= 1.0 or not 0.0 <= slack_credit <= 1.0:
            raise ValueError("tpot_quantile and slack_credit must be in [0, 1]")
        self.tpot_quantile = tpot_quantile
        self.slack_credit = slack_credit
        if max_window_s < 0:
            raise ValueError("max_window_s must be >= 0 (0 = bounded by the TTFT SLO only)")
        self.max_window_s = max_window_s
        self.macros = Macros(macro_size, min_macro, max_macro)
        self.ttft_margin = ttft_margin
        self.tpot_margin = tpot_margin
        self.chunk_tokens = chunk_tokens
        self._by_id: dict[str, InstanceState] = {}
        self._ids: tuple[str, ...] = ()
        self._routed = False  # before the first request the layout may be rebuilt freely
        self._last: tuple[str, InstanceState] | None = None
        # Why requests moved on from an active member: Counter of "ttft" / "tpot" / "kv".
        self.moves: Counter[str] = Counter()
        self.switches = 0

    # ------------------------------------------------------------------ fleet
    def on_fleet_change(self, instances: list[InstanceState], now: float) -> None:
        both = [i for i in instances if i.role is Role.BOTH]
        self._by_id = {i.id: i for i in both}
        ids = [i.id for i in both]
        if self._routed:
            self.macros.sync(ids, now)
        else:
            self.macros.layout(ids, now)
        self._ids = tuple(ids)

    # ------------------------------------------------------------------ placement
    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        both = [i for i in ctx.prefill_candidates if i.role is Role.BOTH]
        if not both:  # a disaggregated pool has no phases to roll: shortest queue
            return ctx.estimator.local(min_queue(ctx.prefill_candidates, ctx.now))
        if tuple(i.id for i in both) != self._ids:
            self.on_fleet_change(both, ctx.now)  # a fleet change the hook did not report
        self._routed = True
        groups = sorted(
            enumerate(self.macros.groups),
            key=lambda p: (self._by_id[p[1].active].busy_until_s, p[0]),
        )
        best: tuple[float, int, Macro, Check] | None = None
        first_fail: str | None = None
        # Pass 1: an active member that can take it (no phase switch anywhere).
        for _, g in groups:
            chk = self._check(ctx, self._by_id[g.active], g.window, g.switch_s)
            if chk.failed is None:
                return self._route(ctx, g, g.active, chk, None)
            first_fail = first_fail or chk.failed
            best = _better(best, (chk.score, 0, g, chk))
        # Pass 2: InterSchedule's move to the next member(s) of the cycle.
        rank = 1
        for _, g in groups:
            iid = g.next_after(g.active)
            while iid != g.active:
                chk = self._check(ctx, self._by_id[iid], None, ctx.now)
                if chk.failed is None:
                    return self._route(ctx, g, iid, chk, first_fail)
                best = _better(best, (chk.score, rank, g, chk))
                rank += 1
                iid = g.next_after(iid)
        assert best is not None
        _, _, g, chk = best
        return self._route(ctx, g, chk.option.instance.id, chk, first_fail)

    def _route(
        self, ctx: PlacementContext, g: Macro, iid: str, chk: Check, moved_by: str | None
    ) -> PrefillOption:
        if iid != g.active:
            self.macros.switch(g, iid, ctx.now)
            self.switches += 1
            if moved_by is not None:
                self.moves[moved_by] += 1
        g.window[ctx.request.request_id] = ctx.request.arrival_s
        self._last = (ctx.request.request_id, chk.option.instance)
        return chk.option

    def select_decode(self, ctx: PlacementContext) -> InstanceState | None:
        """Colocated: the request decodes where it was prefilled."""
        if self._last is not None and self._last[0] == ctx.request.request_id:
            return self._last[1]
        return None

    # ------------------------------------------------------------------ CheckConstraints
    def _check(
        self,
        ctx: PlacementContext,
        inst: InstanceState,
        window: dict[str, float] | None,
        switch_s: float,
    ) -> Check:
        now, req = ctx.now, ctx.request
        slo = ctx.slo
        ttft_slo = slo.ttft_s if slo is not None else DEFAULT_TTFT_SLO_S
        tpot_slo = slo.tbt_s if slo is not None else DEFAULT_TPOT_SLO_S
        opt = ctx.estimator.local(inst)
        chunk = self.chunk_tokens or inst.predictors.profile.max_batched_tokens
        part = decode_part_s(inst)  # what the running decodes add to every mixed step
        new_tokens = req.prompt_tokens - opt.cached_tokens
        steps = -(-(inst.queued_tokens + new_tokens) // chunk)
        ttft = opt.ttft_s + steps * part
        worst = ttft + max(now - req.arrival_s, 0.0)
        # 1. TTFT of the window's pending prefills (FCFS: the newcomer delays none of them,
        # but a window already past its SLO must end: its phase would grow too long).
        if window:
            for rid in [r for r in window if r not in inst.prefill_queue]:
                del window[rid]  # prefilled (or never dispatched): no longer pending
            cum = 0
            for rid, w in inst.prefill_queue.items():
                cum += w.prompt_tokens
                arrival = window.get(rid)
                if arrival is not None:
                    fin = max(w.est_finish_s, now) + -(-cum // chunk) * part
                    worst = max(worst, fin - arrival)
        limit = ttft_slo if self.max_window_s <= 0 else min(ttft_slo, self.max_window_s)
        ttft_over = worst * self.ttft_margin / limit - 1.0
        # 2. TPOT: every saveable decode (running, or created by the queued prefills) keeps
        # enough projected slack for the prefill work still ahead of it.
        head = self._tpot_headroom(inst, opt, now, tpot_slo, part, chunk, new_tokens)
        tpot_over = 0.0 if head is None else -head / ttft_slo
        # 3. KV capacity (and a batch slot) for the prompt and its predicted output.
        need = inst.reserved_tokens + req.prompt_tokens + ctx.predicted_output
        kv_over = need / max(inst.capacity_tokens, 1) - 1.0
        if inst.batch + len(inst.incoming) >= inst.max_batch:
            kv_over = max(kv_over, 0.0) + 1.0
        failed = (
            "ttft" if ttft_over > 0 else "tpot" if tpot_over > 0 else "kv" if kv_over > 0 else None
        )
        # Least-violating order: KV overflow first (it evicts or preempts), then the SLO debt.
        score = 10.0 * max(kv_over, 0.0) + max(ttft_over, 0.0) + max(tpot_over, 0.0)
        if ttft != opt.ttft_s:
            opt = replace(opt, ttft_s=ttft)
        return Check(opt, failed, score, worst, head)

    def _tpot_headroom(
        self,
        inst: InstanceState,
        opt: PrefillOption,
        now: float,
        tpot_slo: float,
        part: float,
        chunk: int,
        new_tokens: int,
    ) -> float | None:
        """The ``tpot_quantile`` of (projected slack - stall ahead) over the saveable decodes.

        A decode stalls for the prefill work ahead of it on its instance: a running one for
        the whole queue plus this prefill, one still queued here (colocated: it decodes
        where it is prefilled) for what is queued after it. ``s`` chunk steps of total
        duration ``P`` cost ``P + s * (part - SLO)`` of slack, since each mixed step still
        yields one token.
        """
        tbt = inst.tbt_now() if inst.batch else inst.predictors.decode.step_time(1, 0)
        gain = (tpot_slo - tbt) * self.slack_credit  # future slack per remaining token
        margin = self.tpot_margin
        new_s = opt.load_s + opt.prefill_s
        heads = []
        # Queued prefills, FCFS: what runs after each of them, then this one.
        after_s = opt.queue_s
        after_tok = inst.queued_tokens
        for rid, w in inst.prefill_queue.items():
            after_s -= max(w.est_finish_s - max(w.est_start_s, now), 0.0)
            after_tok -= w.prompt_tokens
            dw = inst.incoming.get(rid)
            if dw is None:
                continue
            steps = -(-(max(after_tok, 0) + new_tokens) // chunk)
            stall = max(after_s, 0.0) + new_s + steps * (part - tpot_slo)
            heads.append(dw.predicted_output * gain - stall * margin)
        # Running decodes: saved slack so far plus what they will still save.
        steps = -(-(inst.queued_tokens + new_tokens) // chunk)
        stall = (opt.queue_s + new_s + steps * (part - tpot_slo)) * margin
        for slack, _, _ in running_slack(inst, now, tpot_slo, gain):
            if slack >= 0.0:  # past saving: a prefill no longer changes its outcome
                heads.append(slack - stall)
        if not heads:
            return None
        heads.sort()
        return heads[min(int(self.tpot_quantile * len(heads)), len(heads) - 1)]

    # ------------------------------------------------------------------ admin view
    def macro_instances(self, now: float) -> list[dict[str, Any]]:
        """Members, active member and each member's phase, for the admin API."""
        out = []
        for j, g in enumerate(self.macros.groups):
            members = []
            for iid in g.members:
                inst = self._by_id.get(iid)
                since = self.macros.phase_since.get(iid, now)
                members.append(
                    {
                        "id": iid,
                        "phase": "prefill" if iid == g.active else "decode",
                        "phase_age_s": round(max(now - since, 0.0), 3),
                        # A member that left its prefill phase finishes its window first.
                        "queued_prefills": len(inst.prefill_queue) if inst else 0,
                        "decode_batch": inst.batch if inst else 0,
                    }
                )
            out.append(
                {
                    "macro": j,
                    "members": list(g.members),
                    "active": g.active,
                    "phase_age_s": round(max(now - g.switch_s, 0.0), 3),
                    "window_prefills": len(g.window),
                    "instances": members,
                }
            )
        return out


def _better(
    best: tuple[float, int, Macro, Check] | None, cand: tuple[float, int, Macro, Check]
) -> tuple[float, int, Macro, Check]:
    return cand if best is None or cand[:2] < best[:2] else best
