"""A profile measured on the user's own engine: fit, serialise and validate (pure, no I/O).

``kvgate profile`` (backends/profiler.py) sweeps a live engine and hands the timings here. The
fit uses the very forms the predictors evaluate (calibration README §3), so a calibrated profile
drops into ``EngineProfile`` unchanged: prefill P5 ``a + b*max(n, n0) + c*n*(cached + n/2)``
and decode D2 ``a + b*B + k*K``, each by non-negative least squares on relative error. The
measured times already include the engine's per-step overhead, so the profile says so
(``includes_overhead``) and the bundle adds none on top. The sweep's samples travel in the
file: online learning (gateway/learning.py) refits from them plus what the gateway observes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from config.errors import KvgateError
from predictors.decode import DecodeSamples, DecodeStepModel
from predictors.fitting import fit_p5
from predictors.profiles import (
    DecodeCoeffs,
    EngineProfile,
    MixedCoeffs,
    PrefillCoeffs,
    get_profile,
)
from predictors.samples import PrefillSamples

PROFILE_FORMAT = "kvgate-engine-profile"
PROFILE_FORMAT_VERSION = 1
# KV size and engine limits are not measured by a timing sweep: they come from this profile
# unless the sweep read them from the engine (or the user passes them).
BASE_PROFILE = "llama3-8b-h100-tp1"


class ProfileDataError(KvgateError, ValueError):
    """A profile file's content is wrong; ``key`` is the dotted path of the offending value."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"key {key!r}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class SweepSample:
    """One prefill measurement (``batch`` 0) or one decode measurement."""

    new_tokens: int = 0
    cached_tokens: int = 0
    batch: int = 0
    context_tokens: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class FitQuality:
    prefill_samples: int
    prefill_mape_pct: float
    decode_samples: int
    decode_mape_pct: float | None  # None: too few decode samples, the base profile's D2 kept


@dataclass(frozen=True)
class CalibratedProfile:
    """A measured ``EngineProfile`` plus the sweep it came from (the refit's prior)."""

    profile: EngineProfile
    prefill_samples: PrefillSamples
    decode_samples: DecodeSamples | None
    quality: FitQuality
    target: str = ""  # the engine URL that was measured


def prefill_samples(samples: Sequence[SweepSample], source: str) -> PrefillSamples:
    rows = [s for s in samples if s.batch == 0]
    return PrefillSamples(
        new_tokens=np.array([s.new_tokens for s in rows], dtype=np.int64),
        cached_tokens=np.array([s.cached_tokens for s in rows], dtype=np.int64),
        seconds=np.array([s.seconds for s in rows], dtype=np.float64),
        source=source,
        config=None,
        includes_overhead=True,
    )


def decode_samples(samples: Sequence[SweepSample], source: str) -> DecodeSamples:
    rows = [s for s in samples if s.batch > 0]
    return DecodeSamples(
        batch=np.array([s.batch for s in rows], dtype=np.int64),
        context_tokens=np.array([s.context_tokens for s in rows], dtype=np.int64),
        seconds=np.array([s.seconds for s in rows], dtype=np.float64),
        source=source,
    )


def _case_medians(
    x: np.ndarray, z: np.ndarray, seconds: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row per distinct (x, z) with the median time of its repeats: on a shared machine a
    repeat can take several times as long (another process had the cores), and a relative
    least-squares fit would chase it."""
    groups: dict[tuple[int, int], list[float]] = {}
    for a, b, t in zip(x.tolist(), z.tolist(), seconds.tolist(), strict=True):
        groups.setdefault((int(a), int(b)), []).append(float(t))
    keys = sorted(groups)
    return (
        np.array([k[0] for k in keys], dtype=np.float64),
        np.array([k[1] for k in keys], dtype=np.float64),
        np.array([float(np.median(groups[k])) for k in keys], dtype=np.float64),
    )


def _mape(pred: np.ndarray, actual: np.ndarray) -> float:
    return float(np.mean(np.abs(pred / actual - 1.0)) * 100.0)


def fit_profile(
    samples: Sequence[SweepSample],
    *,
    name: str,
    model: str,
    target: str = "",
    base: EngineProfile | None = None,
    kv_capacity_tokens: int | None = None,
    max_batch: int | None = None,
) -> CalibratedProfile:
    """Fit P5 (prefill) and D2 (decode) to a sweep. Needs >= 4 prefill samples; with < 3
    distinct decode cases the base profile's decode coefficients are kept (the quality says so)."""
    base = base or get_profile(BASE_PROFILE)
    pre = prefill_samples(samples, target or name)
    if len(pre) < 4:
        raise ValueError(f"need at least 4 prefill samples to fit, got {len(pre)}")
    if np.any(pre.seconds <= 0):
        raise ValueError("prefill samples must have positive times")
    n, c, y = _case_medians(pre.new_tokens, pre.cached_tokens, pre.seconds)
    p5 = fit_p5(n, c, y * 1000.0)
    prefill = PrefillCoeffs(a_ms=p5.a, b_ms=p5.b, n0=p5.n0, c_ms=p5.c)
    dec = decode_samples(samples, target or name)
    decode, dec_mape = base.decode, None
    b, k, y = _case_medians(dec.batch, dec.context_tokens, dec.seconds)
    if len(y) >= 3 and np.all(y > 0):  # three distinct cases for three coefficients
        step = DecodeStepModel.fit(DecodeSamples(b.astype(np.int64), k.astype(np.int64), y, ""))
        decode = DecodeCoeffs(a_ms=step.a_ms, b_ms=step.b_ms, k_ms=step.k_ms)
        pred = np.array(
            [decode.gpu_ms(b, k) for b, k in zip(dec.batch, dec.context_tokens, strict=True)]
        )
        dec_mape = _mape(pred, dec.seconds * 1000.0)
    profile = replace(
        base,
        name=name,
        model=model,
        gpu="measured",
        tp=1,
        prefill=prefill,
        decode=decode,
        # A mixed step is prefill chunk + decode batch: the two measured forms added up.
        mixed=MixedCoeffs(
            a_ms=prefill.a_ms, b_ms=prefill.b_ms, t0=prefill.n0, c_ms=prefill.c_ms, k_ms=decode.k_ms
        ),
        kv_capacity_tokens=kv_capacity_tokens or base.kv_capacity_tokens,
        max_batch=max_batch or base.max_batch,
        overhead_ms=0.0,
        grid_config="",
        source=f"measured by kvgate profile against {target or 'an engine'}",
        includes_overhead=True,
    )
    quality = FitQuality(len(pre), p5.mape_pct, len(dec), dec_mape)
    return CalibratedProfile(profile, pre, dec if len(dec) else None, quality, target)


# ---------------------------------------------------------------- serialisation
def profile_to_dict(cal: CalibratedProfile) -> dict[str, Any]:
    p = cal.profile
    pre, dec = cal.prefill_samples, cal.decode_samples
    q = cal.quality
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_FORMAT_VERSION,
        "name": p.name,
        "model": p.model,
        "target": cal.target,
        "prefill": {
            "a_ms": p.prefill.a_ms,
            "b_ms": p.prefill.b_ms,
            "n0": p.prefill.n0,
            "c_ms": p.prefill.c_ms,
        },
        "decode": {"a_ms": p.decode.a_ms, "b_ms": p.decode.b_ms, "k_ms": p.decode.k_ms},
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "kv_capacity_tokens": p.kv_capacity_tokens,
        "max_batch": p.max_batch,
        "max_batched_tokens": p.max_batched_tokens,
        "fit": {
            "prefill_samples": q.prefill_samples,
            "prefill_mape_pct": round(q.prefill_mape_pct, 3),
            "decode_samples": q.decode_samples,
            "decode_mape_pct": None if q.decode_mape_pct is None else round(q.decode_mape_pct, 3),
        },
        "samples": {
            "prefill": [
                [int(a), int(b), float(s)]
                for a, b, s in zip(pre.new_tokens, pre.cached_tokens, pre.seconds, strict=True)
            ],
            "decode": []
            if dec is None
            else [
                [int(a), int(b), float(s)]
                for a, b, s in zip(dec.batch, dec.context_tokens, dec.seconds, strict=True)
            ],
        },
    }


def _number(data: Mapping[str, Any], section: str, key: str, *, integer: bool = False) -> Any:
    path = f"{section}.{key}" if section else key
    value = data.get(key)
    if value is None:
        raise ProfileDataError(path, "is missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileDataError(path, f"must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ProfileDataError(path, f"must be a finite number >= 0, got {value!r}")
    if integer:
        if value != int(value):
            raise ProfileDataError(path, f"must be an integer, got {value!r}")
        return int(value)
    return float(value)


def _table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    if not isinstance(value, Mapping):
        raise ProfileDataError(key, "must be a table/object" if value is not None else "is missing")
    return value


def _rows(data: Mapping[str, Any], key: str) -> list[tuple[float, float, float]]:
    value = data.get(key, [])
    rows = []
    if not isinstance(value, list):
        raise ProfileDataError(f"samples.{key}", "must be a list of [x, y, seconds] rows")
    for i, row in enumerate(value):
        ok = (
            isinstance(row, list)
            and len(row) == 3
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in row)
            and all(math.isfinite(v) and v >= 0 for v in row)
            and row[2] > 0
        )
        if not ok:
            msg = f"must be [x, y, seconds > 0], got {row!r}"
            raise ProfileDataError(f"samples.{key}[{i}]", msg)
        rows.append((float(row[0]), float(row[1]), float(row[2])))
    return rows


def profile_from_dict(data: Any, source: str = "<profile>") -> CalibratedProfile:
    """Validate a parsed profile file; ``ProfileDataError`` names the first bad key."""
    if not isinstance(data, Mapping):
        raise ProfileDataError("", "the file must hold a JSON object")
    if data.get("format") != PROFILE_FORMAT:
        raise ProfileDataError("format", f"must be {PROFILE_FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != PROFILE_FORMAT_VERSION:
        raise ProfileDataError("version", f"must be {PROFILE_FORMAT_VERSION}")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ProfileDataError("name", "must be a non-empty string")
    model = data.get("model", name)
    if not isinstance(model, str):
        raise ProfileDataError("model", "must be a string")
    pre_t, dec_t = _table(data, "prefill"), _table(data, "decode")
    prefill = PrefillCoeffs(
        a_ms=_number(pre_t, "prefill", "a_ms"),
        b_ms=_number(pre_t, "prefill", "b_ms"),
        n0=_number(pre_t, "prefill", "n0", integer=True),
        c_ms=_number(pre_t, "prefill", "c_ms"),
    )
    decode = DecodeCoeffs(
        a_ms=_number(dec_t, "decode", "a_ms"),
        b_ms=_number(dec_t, "decode", "b_ms"),
        k_ms=_number(dec_t, "decode", "k_ms"),
    )
    if prefill.a_ms + prefill.b_ms * max(prefill.n0, 1) <= 0:
        raise ProfileDataError("prefill", "predicts zero time for every prompt")
    limits = {}
    for key in ("kv_bytes_per_token", "kv_capacity_tokens", "max_batch", "max_batched_tokens"):
        limits[key] = _number(data, "", key, integer=True)
        if limits[key] < 1:
            raise ProfileDataError(key, "must be >= 1")
    samples = data.get("samples", {})
    if not isinstance(samples, Mapping):
        raise ProfileDataError("samples", "must be a table/object")
    sweep = [SweepSample(int(n), int(c), 0, 0, s) for n, c, s in _rows(samples, "prefill")]
    sweep += [SweepSample(0, 0, int(b), int(k), s) for b, k, s in _rows(samples, "decode")]
    target = data.get("target", "")
    base = get_profile(BASE_PROFILE)
    profile = replace(
        base,
        name=name,
        model=model,
        gpu="measured",
        tp=1,
        prefill=prefill,
        decode=decode,
        mixed=MixedCoeffs(prefill.a_ms, prefill.b_ms, prefill.n0, prefill.c_ms, decode.k_ms),
        overhead_ms=0.0,
        grid_config="",
        source=f"measured profile {source}",
        includes_overhead=True,
        **limits,
    )
    fit = data.get("fit") if isinstance(data.get("fit"), Mapping) else {}
    pre = prefill_samples(sweep, source)
    dec = decode_samples(sweep, source)
    quality = FitQuality(
        len(pre),
        float(fit.get("prefill_mape_pct") or 0.0),
        len(dec),
        fit.get("decode_mape_pct"),
    )
    return CalibratedProfile(profile, pre, dec if len(dec) else None, quality, str(target))
