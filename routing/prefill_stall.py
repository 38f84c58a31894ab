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
) -> Iterator[tuple[float, float]]:
    """``(slack, tokens)`` of each running decode: the slack it ends with if nothing stalls
    it (``gain_s`` credited per token still to come) and the tokens it makes in all.

    ``tokens`` made so far is the reported count plus the steps the instance's step clock
    (advancing at the predicted TBT) ran since the last report: a DecodeWork's
    ``finish_step`` was keyed then as ``clock + expected_remaining()``, which recovers the
    clock of the report. Nothing is mutated (``step_clock`` would advance the books' memo).
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
        yield made * tbt_slo_s - (now - w.started_s) + left * gain_s, made + left


def stalled_tbt(
    inst: InstanceState,
    option: PrefillOption,
    new_tokens: int,
    now: float,
    tbt_slo_s: float,
    credit: float,
) -> float:
    """The highest mean TBT predicted, once ``option``'s prefill has run on ``inst`` (a
    colocated instance), for a decode there that would meet ``tbt_slo_s`` without it: the
    running decodes stall for the whole queue and this prefill, and each request queued
    here (it decodes where it is prefilled) for what is queued after it and this one.
    0.0 when no such decode is there. Decodes that miss the SLO with or without this
    prefill are left out: it does not change their outcome, and counting them would turn
    away every request on a loaded instance."""
    tau = tbt_slo_s
    if tau <= 0.0 or (not inst.running and not inst.incoming):
        return 0.0
    chunk = chunk_tokens(inst)
    part = decode_part_s(inst)
    d = inst.tbt_now() if inst.batch else inst.predictors.decode.step_time(1, 0)
    gain = (tau - d) * credit
    new_s = option.load_s + option.prefill_s
    # The prefill work booked ahead, as predicted: not ``option.queue_s``, whose learned
    # queue scale and wait for a free sequence are time the decodes keep decoding through.
    ahead_s = max(inst.prefill_free_s(now) - now, 0.0)
    worst = 0.0
    # Running decodes: the whole queue, then this prefill.
    queued = inst.queued_tokens
    before = ahead_s + -(-queued // chunk) * (part - tau) if queued else ahead_s
    cost = ahead_s + new_s + -(-(queued + new_tokens) // chunk) * (part - tau)
    for slack, tokens in running_slack(inst, now, tau, gain):
        if slack >= before:
            worst = max(worst, tau + (cost - slack) / tokens)
    # Requests queued here: what runs after their own prefill, then this one.
    after_s = ahead_s
    after_tok = queued
    for rid, w in inst.prefill_queue.items():
        after_s -= max(w.est_finish_s - max(w.est_start_s, now), 0.0)
        after_tok -= w.prompt_tokens
        dw = inst.incoming.get(rid)
        if dw is None or dw.predicted_output <= 1:
            continue
        slack = dw.predicted_output * gain
        ahead = max(after_s, 0.0)
        left = max(after_tok, 0)
        before = ahead + (-(-left // chunk) * (part - tau) if left else 0.0)
        cost = ahead + new_s + -(-(left + new_tokens) // chunk) * (part - tau)
        if slack < before:
            continue
        worst = max(worst, tau + (cost - slack) / dw.predicted_output)
    return worst
