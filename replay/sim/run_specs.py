"""What one simulated run is: a placement policy with an admission mode
(``kvcache_centric+predictive``), as ``kvgate sim --compare`` names them, and the settings that
run it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from config.settings import AdmissionMode, Settings

# Policies with a shipped overload control (admission mode "peer").
PEER_POLICIES = ("sglang_cache_aware", "llmd_weighted", "dynamo_kv")


@dataclass(frozen=True, slots=True)
class RunSpec:
    policy: str
    admission: AdmissionMode

    @property
    def label(self) -> str:
        return f"{self.policy}+{self.admission.value}"


def parse_run_specs(text: str, default_admission: AdmissionMode | None) -> list[RunSpec]:
    """``kvcache_centric+predictive,least_load``; a bare name takes the admission its real
    system ships with (or ``--admission`` when given)."""
    from routing.policies.registry import policy_class

    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, adm = item.partition("+")
        cls = policy_class(name)  # raises PolicyError naming the known policies
        if adm:
            try:
                mode = AdmissionMode(adm)
            except ValueError:
                known = ", ".join(m.value for m in AdmissionMode)
                raise ValueError(
                    f"unknown admission {adm!r} in {item!r} (known: {known})"
                ) from None
        else:
            mode = default_admission or cls.native_admission
        if mode is AdmissionMode.PEER and name not in PEER_POLICIES:
            known = ", ".join(PEER_POLICIES)
            raise ValueError(f"admission 'peer' in {item!r} needs a peer policy ({known})")
        specs.append(RunSpec(name, mode))
    if not specs:
        raise ValueError("no policy given")
    return specs


def with_spec(settings: Settings, spec: RunSpec) -> Settings:
    """``settings`` running ``spec``'s placement policy and admission mode."""
    return replace(
        settings,
        routing=replace(settings.routing, policy=spec.policy),
        admission=replace(settings.admission, mode=spec.admission),
    )
