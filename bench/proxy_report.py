"""`python -m bench.proxy`'s results: medians over rounds (each proxy run paired with the direct
runs beside it), the TTFT rows, the summary against the targets and the printed tables."""

from __future__ import annotations

import json
import statistics

MODES = {"ns": (False, 0.0), "s": (True, 0.0), "sd": (True, 1.0)}  # stream, stub delay ms
SGLANG = ("sglang-rr", "sglang-ca")


def _med(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def aggregate(raw: list[dict]) -> list[dict]:
    """Per (target, mode, c): medians over rounds, each target run paired with the mean of the
    direct runs on either side of it."""
    seqs: dict[tuple, list[dict]] = {}
    for r in raw:
        seqs.setdefault((r["round"], r["mode"], r["c"]), []).append(r)
    per: dict[tuple, list[dict]] = {}
    for seq in seqs.values():
        for i, r in enumerate(seq):
            if r["target"] == "direct":
                continue
            d = [x for x in (seq[i - 1], seq[i + 1] if i + 1 < len(seq) else None) if x]
            d = [x for x in d if x["target"] == "direct"]
            p50s = [x["p50_ms"] for x in d if x["p50_ms"] is not None]
            pair = dict(r)
            pair["direct_rps"] = statistics.mean(x["rps"] for x in d) if d else None
            pair["direct_p50_ms"] = statistics.mean(p50s) if p50s else None
            pair["added_p50_ms"] = (
                r["p50_ms"] - pair["direct_p50_ms"]
                if r["p50_ms"] is not None and pair["direct_p50_ms"] is not None
                else None
            )
            per.setdefault((r["target"], r["mode"], r["c"]), []).append(pair)
    runs = []
    for (target, mode, c), pairs in per.items():
        row = {"target": target, "mode": mode, "c": c}
        for k in ("rps", "p50_ms", "p99_ms", "cpu_us_per_req", "direct_rps", "direct_p50_ms"):
            row[k] = _med([p[k] for p in pairs])
        row["added_p50_ms"] = _med([p["added_p50_ms"] for p in pairs])
        row["rps_ratio"] = _med([p["rps"] / p["direct_rps"] for p in pairs if p["direct_rps"]])
        row["stub_cpu_us_per_req"] = _med([p["stub_cpu_us_per_req"] for p in pairs])
        row["busiest_stub_share"] = _med([p["busiest_stub_share"] for p in pairs])
        row["machine_busy_cores"] = _med([p["machine_busy_cores"] for p in pairs])
        row["errors"] = sum(p["errors"] + p["non_2xx"] for p in pairs)
        row["rounds"] = len(pairs)
        runs.append(row)
    order = {m: i for i, m in enumerate(MODES)}
    runs.sort(key=lambda r: (order[r["mode"]], r["c"], r["target"]))
    return runs


def aggregate_ttft(raw: list[dict]) -> list[dict]:
    direct = {r["round"]: r.get("ttft_p50_ms") for r in raw if r["target"] == "direct"}
    out: dict[str, dict] = {}
    for r in raw:
        row = out.setdefault(r["target"], {"target": r["target"], "_t": [], "_a": [], "_tot": []})
        if "error" in r:
            row["error"] = r["error"]
            continue
        row["_t"].append(r["ttft_p50_ms"])
        row["_tot"].append(r["total_p50_ms"])
        if direct.get(r["round"]) is not None:
            row["_a"].append(r["ttft_p50_ms"] - direct[r["round"]])
    for row in out.values():
        row["ttft_p50_ms"] = _med(row.pop("_t"))
        row["added_ttft_ms"] = _med(row.pop("_a"))
        row["total_p50_ms"] = _med(row.pop("_tot"))
    return list(out.values())


def summarize(runs: list[dict], ttft: list[dict], conc: list[int]) -> dict:
    cmax = max(conc)
    get = {(r["target"], r["mode"], r["c"]): r for r in runs}
    tt = {r["target"]: r for r in ttft}
    checks: dict = {"c_used_for_load_targets": cmax}
    added = (tt.get("kvgate") or {}).get("added_ttft_ms")
    checks["added_ttft_c1"] = {"kvgate_ms": added, "limit_ms": 1.0}
    checks["added_ttft_c1"]["met"] = added is not None and added <= 1.0
    for mode in ("s", "sd"):
        kv = get.get(("kvgate", mode, cmax))
        ratios = {
            sg: round(kv["cpu_us_per_req"] / get[(sg, mode, cmax)]["cpu_us_per_req"], 2)
            for sg in SGLANG
            if kv and (sg, mode, cmax) in get and get[(sg, mode, cmax)]["cpu_us_per_req"]
        }
        by_c = {}
        for c in conc:  # for information: the target is judged at the highest c
            k = get.get(("kvgate", mode, c))
            by_c[c] = {
                sg: round(k["cpu_us_per_req"] / get[(sg, mode, c)]["cpu_us_per_req"], 2)
                for sg in SGLANG
                if k and (sg, mode, c) in get and get[(sg, mode, c)]["cpu_us_per_req"]
            }
        checks[f"cpu_stream_{mode}"] = {
            "kvgate_us": kv["cpu_us_per_req"] if kv else None,
            "ratio_vs": ratios,
            "limit_ratio": 1.5,
            "met": bool(ratios) and max(ratios.values()) <= 1.5,
            "ratio_by_c": by_c,
        }
    kv = get.get(("kvgate", "sd", cmax))
    sg_rps = {sg: get[(sg, "sd", cmax)]["rps"] for sg in SGLANG if (sg, "sd", cmax) in get}
    checks["rps_paced"] = {
        "kvgate_rps": kv["rps"] if kv else None,
        "sglang_rps": sg_rps,
        "ratio_vs": {sg: round(kv["rps"] / v, 2) for sg, v in sg_rps.items() if kv and v},
        # context for the req/s: how each target spread the load over the 4 engines
        "busiest_engine_share": {
            t: get[(t, "sd", cmax)].get("busiest_stub_share")
            for t in ("kvgate", *SGLANG)
            if (t, "sd", cmax) in get
        },
    }
    checks["rps_paced"]["met"] = bool(kv and sg_rps) and all(
        kv["rps"] >= v for v in sg_rps.values()
    )
    checks["all_met"] = all(v.get("met") for v in checks.values() if isinstance(v, dict))
    return checks


def _f(v, nd: int = 2) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def tables(result: dict) -> str:
    names = {"ns": "Non-streaming", "s": "Streaming, 16-token burst", "sd": "Streaming, 1 ms/token"}
    out = []
    for mode, title in names.items():
        rows = [r for r in result["runs"] if r["mode"] == mode]
        if not rows:
            continue
        out += [f"### {title} ({mode})", ""]
        out.append(
            "| c | target | req/s | direct req/s | ratio | p50 ms | direct p50 | added p50 ms "
            "| p99 ms | CPU µs/req | engines' CPU µs/req | busiest engine | errors |"
        )
        out.append("|---" * 13 + "|")
        for r in rows:
            cells = [r["c"], r["target"], _f(r["rps"], 0), _f(r["direct_rps"], 0)]
            cells += [_f(r["rps_ratio"]), _f(r["p50_ms"]), _f(r["direct_p50_ms"])]
            cells += [_f(r["added_p50_ms"]), _f(r["p99_ms"]), _f(r["cpu_us_per_req"], 0)]
            cells += [_f(r["stub_cpu_us_per_req"], 0), _f(r["busiest_stub_share"])]
            cells.append(r["errors"])
            out.append("| " + " | ".join(str(x) for x in cells) + " |")
        out.append("")
    if result["ttft"]:
        out += ["### TTFT at c=1 (keep-alive, stubs at 1 ms/token)", ""]
        out += ["| target | TTFT p50 ms | added TTFT ms | total p50 ms |", "|---|---|---|---|"]
        for r in result["ttft"]:
            tot = _f(r.get("total_p50_ms"))
            ttft_cells = f"{_f(r.get('ttft_p50_ms'))} | {_f(r.get('added_ttft_ms'))}"
            out.append(f"| {r['target']} | {ttft_cells} | {tot} |" + (r.get("error") or ""))
        out.append("")
    out += ["### Targets", "", "```", json.dumps(result["summary"], indent=1), "```"]
    return "\n".join(out)
