"""How long an engine that took a request may send nothing before the gateway aborts it."""

from __future__ import annotations

from config.settings import ServerSettings
from routing.types import Decision

# max_tokens may be any huge integer the client sent; no engine generates more than its
# context (a few million tokens at most), so it is capped before the float product.
_MAX_ANSWER_TOKENS = 1 << 24


def silence_timeout_s(srv: ServerSettings, d: Decision, whole_answer_tokens: int = 0) -> float:
    """A multiple of the predicted TTFT or of the TTFT SLO, whichever is larger, within the
    configured bounds (a prediction of 0 or an odd SLO cannot make it tiny or endless). A
    non-streamed answer's first byte comes after its last token, so for one the same
    multiples of the generation time (``whole_answer_tokens`` x TBT) are added on top."""
    t = max(
        srv.silence_predicted_factor * d.predicted_ttft_s,
        srv.silence_slo_factor * d.slo_ttft_s,
    )
    generation = min(whole_answer_tokens, _MAX_ANSWER_TOKENS) * max(
        srv.silence_predicted_factor * d.predicted_tbt_s,
        srv.silence_slo_factor * d.slo_tbt_s,
    )
    return min(max(t, srv.silence_min_s), srv.silence_max_s) + generation
