"""``--compare`` items (replay/sim/run_specs.py): a policy with an admission mode, its native
admission when none is named, clear errors for unknown names, and the settings that run it."""

from __future__ import annotations

import pytest

from config.settings import AdmissionMode, Settings
from replay.sim.run_specs import RunSpec, parse_run_specs, with_spec
from routing.policies.registry import PolicyError, policy_class


def test_items_name_policy_and_admission_and_a_bare_name_takes_its_native_one() -> None:
    specs = parse_run_specs(" kvcache_centric+predictive, least_load ,", None)
    native = policy_class("least_load").native_admission
    assert specs == [
        RunSpec("kvcache_centric", AdmissionMode.PREDICTIVE),
        RunSpec("least_load", native),
    ]
    assert specs[0].label == "kvcache_centric+predictive"
    # --admission replaces the native one for bare names only
    early = parse_run_specs("least_load,kvcache_centric+none", AdmissionMode.EARLY)
    assert [s.admission for s in early] == [AdmissionMode.EARLY, AdmissionMode.NONE]


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ("kvcache_centric+maybe", ValueError, "unknown admission 'maybe'.*known: "),
        ("no_such_policy", PolicyError, "no_such_policy"),
        (" , ", ValueError, "no policy given"),
    ],
)
def test_bad_items_are_refused_by_name(text: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        parse_run_specs(text, None)


def test_with_spec_sets_policy_and_admission_only() -> None:
    base = Settings()
    s = with_spec(base, RunSpec("least_load", AdmissionMode.EARLY))
    assert s.routing.policy == "least_load" and s.admission.mode is AdmissionMode.EARLY
    assert s.slo == base.slo and s.pools == base.pools
