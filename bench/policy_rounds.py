"""Several policies measured in alternating rounds, and their ratios taken within each round.

On a shared machine the load drifts over a benchmark's minutes; running the policies in
rounds whose order reverses every other round, and comparing them only within a round, keeps
that drift from favouring the policy that ran at the quiet moment."""

from __future__ import annotations

import statistics
from typing import Any


def round_orders(policies: list[str], rounds: int) -> list[list[str]]:
    """The policies' order in each round: reversed every other round (A B, B A, A B ...), so
    that a drift of the machine's load over the runs weighs on every policy alike."""
    return [policies if r % 2 == 0 else policies[::-1] for r in range(rounds)]


RATIO_KEYS = ("ttft_mean_s", "ttft_p90_s", "engine_hit_ratio")


def ratios(
    runs: list[dict[str, Any]], reference: str, keys: tuple[str, ...] = RATIO_KEYS
) -> dict[str, Any]:
    """Each policy's ``keys`` against ``reference`` within each round (same engines' machine
    state), then the median over rounds: ``{policy: {key: {"per_round": [...], "median": m}}}``."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run.get("round", 0), {})[run["policy"]] = run
    out: dict[str, Any] = {}
    for rnd in sorted(by_round):
        ref = by_round[rnd].get(reference)
        for policy, run in by_round[rnd].items():
            if policy == reference or ref is None:
                continue
            for key in keys:
                if run.get(key) is not None and ref.get(key):
                    cell = out.setdefault(policy, {}).setdefault(key, {"per_round": []})
                    cell["per_round"].append(round(run[key] / ref[key], 4))
    for cells in out.values():
        for cell in cells.values():
            cell["median"] = statistics.median(cell["per_round"])
    return out
