"""What a colocated engine's prefill work does to the decodes running beside it.

A colocated engine (vLLM's chunked prefill, llama.cpp's slots, SGLang's mixed chunks) runs a
new prompt in steps that also carry one token of every running decode: such a step lasts the
prompt chunk's time plus the decode part, so each decode on the instance waits through every
prefill that runs there while it decodes. The TBT SLO is on a request's mean TBT, so a decode
has a budget it spends: ``g`` tokens made in ``e`` seconds since its first token and ``r``
predicted to come end within the SLO ``tau`` when ``g * tau - e + r * (tau - d)`` (its slack;
``d`` the decode-only step) covers the stalls still ahead of it. ``s`` mixed steps of total
prefill time ``P`` cost ``P + s * (part - tau)`` of slack, as each of them still yields one
token (EcoServe's CheckConstraints, arXiv 2504.18154 Algorithm 2; routing/policies/ecoserve.py).

A decode's own check at admission sees only the decode-only step (``InstanceState.tbt_now``):
in a colocated fleet the prefills admitted after it are what push it over the SLO (in the
simulator, up to 92 % of the admitted requests of a loaded fleet missed their TBT SLO that way,
docs/experiments.md §2.7). So the TBT check of a request placed on a colocated instance also
asks what its prefill does to the decodes already there (``stalled_tbt``): the worst mean TBT
it predicts among those that would still meet the SLO without it. Future slack is credited at
``credit`` (< 1: output lengths are predicted, and a shorter output than predicted leaves less
of it; routing/stall_credit.py learns it).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from routing.estimates import PrefillOption
from routing.instance_books import InstanceState


def decode_part_s(inst: InstanceState) -> float:
    """What the running decodes add to each mixed step (the decode step without its fixed
    part): ``b * batch + k * context``."""
    dec = inst.predictors.decode
    return (dec.b_ms * inst.batch + dec.k_ms * inst.context_tokens) / 1000.0


def chunk_tokens(inst: InstanceState) -> int:
    """The engine's prompt tokens per step (vLLM's ``max_num_batched_tokens``)."""
    return max(inst.predictors.profile.max_batched_tokens, 1)


def running_slack(
    inst: InstanceState, now: float, tbt_slo_s: float, gain_s: float
) -> Iterator[tuple[float, float, float]]:
    """``(slack, made, left)`` of each running decode: the slack it ends with if nothing
    stalls it (``gain_s`` credited per token still to come), the tokens it made and the
    tokens it is predicted still to make.

    ``made`` is the reported count plus the steps the instance's step clock (advancing at the
    predicted TBT) ran since the last report: a DecodeWork's ``finish_step`` was keyed then as
    ``clock + expected_remaining()``, which recovers the clock of the report. Nothing is
    mutated (``step_clock`` would advance the books' memo).
    """
    if not inst.running:
        return
    clock = inst.steps
    if now > inst.steps_at_s:
        clock += (now - inst.steps_at_s) / max(inst.tbt_now(), 1e-4)
    for w in inst.running.values():
        if w.started_s is None:
            continue
        keyed = w.finish_step - w.expected_remaining()
        made = w.generated + max(clock - keyed, 0.0)
        left = max(w.predicted_output - made, w.predicted_output / 4, 1.0)
        yield made * tbt_slo_s - (now - w.started_s) + left * gain_s, made, left


class _BookedPrefills:
    """The prefills booked on an instance, FCFS from ``now`` at their predicted (unscaled)
    durations: which of them start before a given time, and their work and tokens."""

    __slots__ = ("done_s", "starts", "tokens", "work")

    def __init__(self, inst: InstanceState, now: float) -> None:
        self.starts: list[float] = []
        self.work = [0.0]  # cumulative predicted seconds
        self.tokens = [0]  # cumulative prompt tokens
        t = now
        for w in inst.prefill_queue.values():
            self.starts.append(t)
            t += max(w.est_finish_s - max(w.est_start_s, now), 0.0)  # an overdue head: 0
            self.work.append(t - now)
            self.tokens.append(self.tokens[-1] + w.prompt_tokens)
        self.done_s = t

    def before(self, end_s: float, first: int) -> tuple[float, int]:
        """Work and tokens of the prefills from index ``first`` on that start before
        ``end_s``."""
        k = max(bisect_left(self.starts, end_s, lo=first), first)
        return self.work[k] - self.work[first], self.tokens[k] - self.tokens[first]


def stalled_tbt(
    inst: InstanceState,
    option: PrefillOption,
    new_tokens: int,
    now: float,
    tbt_slo_s: float,
    credit: float,
    limit_s: float | None = None,
) -> float:
    """The highest mean TBT predicted, once ``option``'s prefill has run on ``inst`` (a
    colocated instance), for a decode there that would meet ``tbt_slo_s`` without it.

    A decode stalls for the prefills that start before it ends (at its predicted remaining
    tokens, decode-only steps): a running one for the booked queue's, a request queued here
    (it decodes where it is prefilled) for those queued after it; the new prefill starts
    after the queue and, on a full engine, when a sequence frees (``option.queue_s``), so
    a decode that ends before then is not its concern. The queue counts at its predicted
    work, not ``option.queue_s``: the learned queue scale and the wait for a sequence are
    time the decodes keep decoding through. ``limit_s``: the TBT the new request's class
    admits (its headroom kept). 0.0 when no such decode is there. Decodes that
    miss the SLO with or without this prefill are left out: it does not change their
    outcome, and counting them would turn away every request on a loaded instance."""
    tau = tbt_slo_s
    if tau <= 0.0 or (not inst.running and not inst.incoming):
        return 0.0
    chunk = chunk_tokens(inst)
    step_cost = decode_part_s(inst) - tau  # each chunk step also yields a token

    def steps(tokens: int) -> float:
        return -(-tokens // chunk) * step_cost if tokens > 0 else 0.0

    d = inst.tbt_now() if inst.batch else inst.predictors.decode.step_time(1, 0)
    gain = (tau - d) * credit
    keep = 1.0 if limit_s is None else min(limit_s / tau, 1.0)  # the class keeps its headroom
    new_s = option.load_s + option.prefill_s
    booked = _BookedPrefills(inst, now)
    # The option's wait, unscaled: queue_time already waited for a sequence on a full engine.
    start = max(now + option.queue_s / inst.queue_scale, booked.done_s)

    def stalled(slack: float, tokens: float, end_s: float, first: int, queued: bool) -> float:
        """The mean TBT of one decode after this prefill; 0.0 when it is not its concern.
        ``queued``: a request queued here, not decoding yet."""
        if start >= end_s:
            return 0.0  # done before this prefill starts
        work, ahead = booked.before(end_s, first)
        if slack < work + steps(ahead):
            return 0.0  # the queue alone takes it past the SLO
        if queued and work + new_s <= (tau - d) * keep:
            # Safe whatever its output length: even with a second token after all of these
            # stalls its mean TBT keeps within the class's limit. The credit's hedge would
            # put it at tau - credit x (tau - d) before any stall, over a class limit below
            # tau for credits under ~0.1, and turn away a burst onto an idle instance.
            return 0.0
        return tau + (work + new_s + steps(ahead + new_tokens) - slack) / tokens

    worst = 0.0
    for slack, made, left in running_slack(inst, now, tau, gain):
        worst = max(worst, stalled(slack, made + left, now + left * d, 0, False))
    for i, rid in enumerate(inst.prefill_queue):
        dw = inst.incoming.get(rid)
        if dw is None or dw.predicted_output <= 1:
            continue
        out = dw.predicted_output
        begins = now + booked.work[i + 1]  # its prefill done
        worst = max(worst, stalled(out * gain, out, begins + out * d, i + 1, True))
    return worst
