"""How a simulation runs: sampling, the clients' max_tokens, where the first token counts from,
and the network model (replay/sim/simulator.py takes them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimOptions:
    sample_interval_s: float = 5.0  # load samples and token progress reports
    # The max_tokens a client asks for. Traces give the length actually generated; using it as
    # max_tokens would hand the output-length predictor the answer, so requests ask for at least
    # this many and the engine stops at the trace's length (as if at an end-of-sequence token).
    max_tokens: int = 2048
    # When the client sees the first token. False: at the end of the prefill (Mooncake, which
    # overlaps the KV transfer with the prefill layer by layer); the wait to join the decode
    # batch then falls in the first gap between tokens. True: when the decode instance takes
    # the request into its batch at a step boundary after the KV arrived, and streams the
    # first token (SGLang P/D on the wire; vLLM NIXL one step later, as the live emulator);
    # the join wait then counts in TTFT, and the gaps are decode steps.
    ttft_after_transfer: bool = False
    # How KV transfers share a NIC (replay.engine.network.NETWORK_MODELS): "calendar" sends
    # one at a time per link direction, reserved up front (the model of the tables in docs/);
    # "fair" splits each link's bandwidth among the transfers on it.
    network: str = "calendar"
    label: str | None = None
