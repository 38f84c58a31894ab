"""A learned correction of the queue wait the books predict for one instance.

The books (routing/instance_books.py) predict how long a new prefill waits as the predicted
work booked ahead of it. On a real engine that work rarely takes exactly its predictions added
up: llama.cpp batches the prompts of its slots and interleaves their decodes in one loop, vLLM
mixes chunked prefills into decode steps, and CPU engines on a shared machine slow each other.
Measured in front of two real llama-servers under overload (docs/real-engines.md, "Admission
under overload"): the first token came 17-21 % later than predicted (median) for the requests
admission let in, and so half of them missed the SLO it had promised.

Each answered request of a colocated instance whose predicted wait mattered tells how long it
really waited: its observed TTFT less its predicted prefill (the prefill model has its own
refits). The correction is an exponentially weighted mean of log(observed / predicted) — the
prediction already includes the correction, so each step moves it by ``rate`` times the log of
the error that remains — clamped to [1/4, 4] (one wild observation moves it by at most
``rate`` x log 8). A multiplicative scale, because queue errors grow with the queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_SCALE, MAX_SCALE = 0.25, 4.0
_LOG_MIN, _LOG_MAX = math.log(MIN_SCALE), math.log(MAX_SCALE)
_STEP_LIMIT = math.log(8.0)  # one observation's log error counts at most this much
MIN_QUEUE_S = 0.01  # below this a predicted wait says nothing about the queue model
MIN_QUEUE_SHARE = 0.25  # ... nor where it is under this share of the predicted TTFT


@dataclass(slots=True)
class QueueScale:
    rate: float
    log_scale: float = 0.0
    samples: int = 0

    @property
    def scale(self) -> float:
        return math.exp(self.log_scale)

    def observe(self, predicted_queue_s: float, predicted_ttft_s: float, waited_s: float) -> bool:
        """One answered request: it was predicted to wait ``predicted_queue_s`` (scaled
        already) of a ``predicted_ttft_s``, and waited ``waited_s``. False when the
        prediction is too small to learn from."""
        if predicted_queue_s < max(MIN_QUEUE_S, MIN_QUEUE_SHARE * predicted_ttft_s):
            return False
        error = math.log(max(waited_s, 1e-3) / predicted_queue_s)
        error = min(max(error, -_STEP_LIMIT), _STEP_LIMIT)
        self.log_scale = min(max(self.log_scale + self.rate * error, _LOG_MIN), _LOG_MAX)
        self.samples += 1
        return True
