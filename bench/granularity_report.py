"""The object-count sweep's analysis and output (``bench/granularity.py``): acceptance checks, table and plot.

:func:`analyse` works from the rows alone (so ``--report`` recomputes it for an earlier run's JSON): per path the
least-squares slope against N and the max/min of the medians across N, and the acceptance checks of issue 3 (Range
flat across N, Range-Valkey against the fastest LMCache path, Range-DRAM against the resident copy).
:func:`print_report` prints the table of a result document (its ``analysis`` included); :func:`plot` writes the PNG
and returns its path, or a reason when matplotlib is missing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench_common import GIB, MIB, log
from bench_kv_layout import BLOCK_SIZE, BYTES_PER_TOKEN_PER_LAYER, NUM_LAYERS
from granularity_baselines import LMCACHE_OVER_RANGE_PATHS, LMCACHE_VALKEY_PATHS, ROW_LABELS


# ---------------------------------------------------------------------------------------------------- analysis
def fit_slope(points: list[tuple[int, float]]) -> dict[str, float] | None:
    """Least-squares ``t = a + b * N``; ``b`` in seconds per object."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0:
        return None
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    a = my - b * mx
    return {"slope_s_per_object": b, "slope_us_per_object": b * 1e6, "intercept_s": a}


def analyse(rows: list[dict[str, Any]], chunks: list[int], payload_tokens: int) -> dict[str, Any]:
    ok = [r for r in rows if r.get("status") == "ok" and r.get("restore_s_median") is not None]
    by_path: dict[str, dict[int, dict[str, Any]]] = {}
    for r in ok:
        by_path.setdefault(r["path"], {})[r["chunk_tokens"]] = r
    n_of = {c: payload_tokens // c * NUM_LAYERS for c in chunks}
    out: dict[str, Any] = {"num_objects_by_chunk_tokens": n_of, "paths": {}}
    for path, rs in by_path.items():
        pts = sorted((n_of[c], r["restore_s_median"]) for c, r in rs.items())
        meds = [p[1] for p in pts]
        best = [r["restore_s_min"] for r in rs.values() if r.get("restore_s_min")]
        out["paths"][path] = {
            "medians_by_N": {str(n): t for n, t in pts},
            "fit": fit_slope(pts),
            "max_over_min": max(meds) / min(meds) if meds else None,
            # Diagnostic, less sensitive to other processes on a shared machine: the same ratio over each N's
            # fastest repeat.
            "max_over_min_of_best": max(best) / min(best) if len(best) == len(rs) and best else None,
        }
    coarse, fine = max(chunks), min(chunks)  # coarsest N = largest chunk
    acc: dict[str, Any] = {"coarsest": {"chunk_tokens": coarse, "N": n_of[coarse]},
                           "finest": {"chunk_tokens": fine, "N": n_of[fine]}}
    # 1. Range flat across N.
    flat = {}
    for path in sorted(p for p in by_path if p.startswith("range_")):
        rs = by_path[path]
        ratio = out["paths"][path]["max_over_min"]
        counts = {c: {k: (r.get("client_counts_restore") or {}).get(k) for k in
                      ("round_trips", "commands", "allocations", "copy_launches")}
                  for c, r in rs.items()}
        counts_w = {c: (r.get("worker_stats_restore") or {}).get("copy_launches") for c, r in rs.items()}
        server = {c: r.get("server_commands_restore") for c, r in rs.items()}
        flat[path] = {
            "max_over_min": ratio, "holds": ratio is not None and ratio <= 1.05 and len(rs) == len(chunks),
            "max_over_min_of_best": out["paths"][path]["max_over_min_of_best"],
            "n_points": len(rs),
            "backend_counters_constant": len({json.dumps(v, sort_keys=True) for v in counts.values()}) == 1,
            "worker_copy_launches_constant": len(set(counts_w.values())) == 1,
            "server_commands_constant": len({json.dumps(v, sort_keys=True) for v in server.values()}) == 1,
        }
    acc["range_flat"] = flat
    # 2. Range-Valkey vs LMCache.
    rv = by_path.get("range_valkey", {})
    lm = {p: by_path[p] for p in by_path
          if p.startswith("lmcache_") and p.removeprefix("lmcache_") not in LMCACHE_OVER_RANGE_PATHS}
    vs: dict[str, Any] = {}
    for label, c in (("coarsest", coarse), ("finest", fine)):
        entry: dict[str, Any] = {}
        r = rv.get(c)
        cands_all = {p: rs[c]["restore_s_median"] for p, rs in lm.items() if c in rs}
        cands_valkey = {p: t for p, t in cands_all.items() if p.removeprefix("lmcache_") in LMCACHE_VALKEY_PATHS}
        for scope, cands in (("any_lmcache_path", cands_all), ("lmcache_over_valkey", cands_valkey)):
            if r is None or not cands:
                entry[scope] = None
                continue
            best = min(cands, key=cands.get)
            ratio = r["restore_s_median"] / cands[best]
            entry[scope] = {"fastest": best, "fastest_s": cands[best], "range_valkey_s": r["restore_s_median"],
                            "range_over_fastest": ratio,
                            "holds": ratio <= 1.10 if label == "coarsest" else ratio < 1.0}
        vs[label] = entry
    acc["range_valkey_vs_fastest_lmcache"] = vs
    speedups = {}
    r = rv.get(fine)
    for p in ("lmcache_resp", "lmcache_valkey"):
        o = by_path.get(p, {}).get(fine)
        if r is None or o is None:
            speedups[p] = None
            continue
        s = o["restore_s_median"] / r["restore_s_median"]
        speedups[p] = {"lmcache_s": o["restore_s_median"], "range_valkey_s": r["restore_s_median"],
                       "speedup": s, "holds": s >= 3.0}
    acc["range_valkey_speedup_at_finest"] = speedups
    # 3. Range-DRAM vs resident.
    dram = by_path.get("range_memory", {})
    res = by_path.get("resident", {})
    res_shim = by_path.get("resident_shim", {})
    per_n = {}
    for c in chunks:
        d, rr = dram.get(c), res.get(c)
        if d is None or rr is None:
            continue
        ratio = d["restore_s_median"] / rr["restore_s_median"]
        e = {"N": n_of[c], "range_memory_s": d["restore_s_median"], "resident_s": rr["restore_s_median"],
             "ratio": ratio, "holds": ratio <= 1.25}
        if c in res_shim:
            e["resident_shim_s"] = res_shim[c]["restore_s_median"]
            e["ratio_vs_resident_shim"] = d["restore_s_median"] / res_shim[c]["restore_s_median"]
        per_n[str(c)] = e
    acc["range_dram_vs_resident"] = {"per_chunk_tokens": per_n,
                                     "holds": bool(per_n) and all(e["holds"] for e in per_n.values())}
    acc["lmcache_range_adapter"] = range_adapter_acceptance(by_path, out["paths"], chunks, n_of)
    out["acceptance"] = acc
    return out


def range_adapter_acceptance(by_path: dict[str, dict[int, Any]], paths: dict[str, Any], chunks: list[int],
                             n_of: dict[int, int]) -> dict[str, Any] | None:
    """Issue 21: the "LMCache MP + Range adapter" row flat (max/min of medians <= 1.05 over every N) and faster than
    "LMCache MP + resp adapter" at every N, in the same run; ``None`` without either row."""
    rng, resp = by_path.get("lmcache_mp_l2_range"), by_path.get("lmcache_mp_l2_resp")
    if not rng or not resp:
        return None
    ratio = paths["lmcache_mp_l2_range"]["max_over_min"]
    def load_s(row: dict[str, Any]) -> float | None:
        return (row.get("client_s_medians") or {}).get("load_wait_s")

    per_n = {str(n_of[c]): {"chunk_tokens": c, "range_s": rng[c]["restore_s_median"],
                            "resp_s": resp[c]["restore_s_median"],
                            "range_over_resp": rng[c]["restore_s_median"] / resp[c]["restore_s_median"],
                            "range_load_s": load_s(rng[c]), "resp_load_s": load_s(resp[c]),
                            "range_copy_s": rng[c].get("shim_copy_s_median"),
                            "range_l1_allocate_s": (rng[c].get("client_s_medians") or {}).get("l1_allocate_s")}
             for c in chunks if c in rng and c in resp}
    loads = [e["range_load_s"] for e in per_n.values() if e["range_load_s"]]
    return {"max_over_min": ratio, "flat": ratio is not None and ratio <= 1.05 and len(rng) == len(chunks),
            "load_max_over_min": max(loads) / min(loads) if len(loads) == len(chunks) and loads else None,
            "per_N": per_n,
            "faster_at_every_N": len(per_n) == len(chunks) and all(e["range_over_resp"] < 1.0 for e in per_n.values())}


# ---------------------------------------------------------------------------------------------------- output
def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(doc: dict[str, Any]) -> None:
    rows, chunks = doc["rows"], doc["config"]["chunk_tokens"]
    n_of = doc["analysis"]["num_objects_by_chunk_tokens"]
    m = doc["machine"]
    log("")
    log("=" * 118)
    log(f"granularity sweep: {doc['config']['payload_bytes'] / MIB:.0f} MiB of KV ({doc['config']['payload_tokens']} "
        f"tokens x {NUM_LAYERS} layers x {BYTES_PER_TOKEN_PER_LAYER} B), block {BLOCK_SIZE}, median of "
        f"{doc['config']['repeats']} (Range/resident) / {doc['config']['lmcache_repeats']} (shim) restores after "
        f"{doc['config']['warmup']} warm-up")
    busy = sorted({r["busy_cores_before"] for r in rows if r.get("busy_cores_before") is not None})
    log(f"machine: {m['cpu_model']}, {m['cpu_count']} cores, {m['mem_total_bytes'] / GIB:.0f} GiB; load average "
        f"at start {m['loadavg']} ({m.get('busy_cores_2s')} cores busy), at end {doc['machine_end']['loadavg']}; "
        f"cores busy before each tier/shim step {busy[0] if busy else '-'}-{busy[-1] if busy else '-'}; torch "
        f"threads {doc['config']['torch_threads']}")
    log(f"Range Valkey data path: {doc['range_valkey_data_path']}")
    gs = doc.get("git") or {}
    when = "at start" if "git_at_end" in doc else "at end of run (this JSON predates start-of-run records)"
    log(f"Range code {when}: HEAD {gs.get('head', '?')[:10]} ({gs.get('head_subject', '')[:60]}); uncommitted in "
        f"range_connector/: {', '.join(x.split()[-1] for x in gs.get('dirty', [])) or 'none'}")
    log(f"command: {doc['command']}")
    log("-" * 118)
    paths = []
    for r in rows:
        if r["path"] not in paths:
            paths.append(r["path"])
    head = f"{'restore median, s':26s}" + "".join(f"{'N=' + str(n_of[c]):>10s}" for c in chunks) + \
        f"{'GiB/s':>14s}{'us/object':>11s}{'max/min':>9s}{'(best)':>8s}"
    log(head)
    log(f"{'(chunk tokens)':26s}" + "".join(f"{'C=' + str(c):>10s}" for c in chunks))
    an = doc["analysis"]["paths"]
    for p in paths:
        cells = []
        gibs = []
        for c in chunks:
            r = next((x for x in rows if x["path"] == p and x["chunk_tokens"] == c), None)
            if r is None:
                cells.append(f"{'':>10s}")
            elif r.get("status") != "ok" or r.get("restore_s_median") is None:
                cells.append(f"{r.get('status', '?'):>10s}")
            else:
                cells.append(f"{r['restore_s_median']:10.4f}")
                gibs.append(r["gib_per_s"])
        a = an.get(p, {})
        fit = a.get("fit") or {}
        g = f"{min(gibs):.2f}-{max(gibs):.2f}" if gibs else "-"
        log(f"{p:26s}" + "".join(cells) + f"{g:>14s}{fmt(fit.get('slope_us_per_object'), '.1f'):>11s}"
            f"{fmt(a.get('max_over_min'), '.3f'):>9s}{fmt(a.get('max_over_min_of_best'), '.3f'):>8s}")
    for title, key, scale, spec in (("time to first layer, median s", "first_layer_s_median", 1.0, "10.4f"),
                                     ("lookup, median ms", "lookup_s_median", 1e3, "10.2f")):
        log("-" * 118)
        log(f"{title:26s}" + "".join(f"{'N=' + str(n_of[c]):>10s}" for c in chunks))
        for p in paths:
            cells = []
            for c in chunks:
                r = next((x for x in rows if x["path"] == p and x["chunk_tokens"] == c), None)
                v = None if r is None or r.get("status") != "ok" else r.get(key)
                cells.append(f"{'-':>10s}" if v is None else format(v * scale, spec))
            log(f"{p:26s}" + "".join(cells))
    log("  (Range is driven layer-pipelined: first layer = when the first wait_for_layer returned; LMCache local_cpu "
        "retrieves layer-wise)")
    log("-" * 118)
    log("Range restore counters (per restore; identical at every N unless noted), lookup and time to first layer:")
    for p in [p for p in paths if p.startswith("range_")]:
        rs = [r for r in rows if r["path"] == p and r.get("status") == "ok"]
        if not rs:
            continue
        cc = {json.dumps(r.get("client_counts_restore"), sort_keys=True) for r in rs}
        sc = {json.dumps(r.get("server_commands_restore"), sort_keys=True) for r in rs}
        wc = {(r.get("worker_stats_restore") or {}).get("copy_launches") for r in rs}
        log(f"  {p}: backend {', '.join(sorted(cc))}" + ("" if len(cc) == 1 else "  <- VARIES"))
        log(f"  {' ' * len(p)}  worker copy_launches {sorted(wc, key=str)}; server commands {', '.join(sorted(sc))}"
            + ("" if len(sc) == 1 else "  <- VARIES"))
        lk = [r.get("lookup_s_median") for r in rs]
        log(f"  {' ' * len(p)}  lookup median {min(lk) * 1e3:.2f}-{max(lk) * 1e3:.2f} ms; plan "
            f"{min(r['plan_s_median'] for r in rs) * 1e3:.1f}-{max(r['plan_s_median'] for r in rs) * 1e3:.1f} ms; "
            f"first layer {min(r['first_layer_s_median'] for r in rs):.3f}-"
            f"{max(r['first_layer_s_median'] for r in rs):.3f} s")
        for r in (rs[-1], rs[0]) if len(rs) > 1 else rs[:1]:
            b = r.get("breakdown")
            if b:
                parts = ", ".join(f"{k[:-2]} {v:.3f}" for k, v in b.items()
                                  if k.endswith("_s") and k != "restore_s" and (v >= 0.0005 or k == "rest_s"))
                log(f"  {' ' * len(p)}  breakdown C={r['chunk_tokens']} (1 instrumented restore of {b['restore_s']:.3f} "
                    f"s): {parts}")
        if rs[0].get("cold_method"):
            log(f"  {' ' * len(p)}  cold: {rs[0]['cold_method']}")
    other = [p for p in paths if not p.startswith("range_") and p != "resident"]
    if other:
        log("Shim rows, server commands per restore at the finest / coarsest N:")
        for p in other:
            rs = {r["chunk_tokens"]: r for r in rows if r["path"] == p and r.get("status") == "ok"}
            if rs:
                f, c = rs.get(min(chunks)), rs.get(max(chunks))
                log(f"  {p}: {json.dumps((f or {}).get('server_commands_restore'))} / "
                    f"{json.dumps((c or {}).get('server_commands_restore'))}")
    for r in rows:
        if r.get("status") not in ("ok", None):
            log(f"  ! {r['path']} C={r['chunk_tokens']}: {r['status']}: {r.get('reason')}")
    for note in doc.get("notes", []):
        log(f"  note: {note}")
    log("-" * 118)
    acc = doc["analysis"]["acceptance"]
    log("Acceptance (issue 3):")
    for p, e in acc["range_flat"].items():
        log(f"  [{'PASS' if e['holds'] else 'FAIL'}] {p}: max/min of medians across N = {fmt(e['max_over_min'])} "
            f"(<= 1.05; of each N's fastest repeat: {fmt(e.get('max_over_min_of_best'))}); backend counters "
            f"constant: {e['backend_counters_constant']}, server commands constant: {e['server_commands_constant']}")
    for label in ("coarsest", "finest"):
        for scope, e in acc["range_valkey_vs_fastest_lmcache"][label].items():
            if e is None:
                log(f"  [ -- ] Range-Valkey vs fastest LMCache ({scope}) at {label} N: no data")
                continue
            want = "<= 1.10" if label == "coarsest" else "< 1.00"
            log(f"  [{'PASS' if e['holds'] else 'FAIL'}] Range-Valkey / fastest LMCache ({scope}: {e['fastest']}) at "
                f"{label} N={acc[label]['N']}: {e['range_valkey_s']:.4f} / {e['fastest_s']:.4f} = "
                f"{e['range_over_fastest']:.2f} ({want})")
    for p, e in acc["range_valkey_speedup_at_finest"].items():
        if e is None:
            log(f"  [ -- ] Range-Valkey vs {p} at finest N: no data")
        else:
            log(f"  [{'PASS' if e['holds'] else 'FAIL'}] {p} / Range-Valkey at finest N: {e['lmcache_s']:.4f} / "
                f"{e['range_valkey_s']:.4f} = {e['speedup']:.2f}x (>= 3x)")
    ra = acc.get("lmcache_range_adapter")
    if ra is None:
        log("  [ -- ] LMCache MP + Range adapter vs + resp adapter (issue 21): no data")
    else:
        cells = ", ".join(f"N={n}: {e['range_s']:.3f} / {e['resp_s']:.3f}" for n, e in ra["per_N"].items())
        log(f"  [{'PASS' if ra['flat'] else 'FAIL'}] {ROW_LABELS['lmcache_mp_l2_range']}: max/min across N = "
            f"{fmt(ra['max_over_min'])} (<= 1.05)")
        log(f"  [{'PASS' if ra['faster_at_every_N'] else 'FAIL'}] {ROW_LABELS['lmcache_mp_l2_range']} / "
            f"{ROW_LABELS['lmcache_mp_l2_resp']} < 1 at every N: {cells}")
        split = ", ".join(f"N={n}: {fmt(e['range_load_s'])} / {fmt(e['resp_load_s'])} "
                          f"(L1 {fmt(e['range_l1_allocate_s'])}, copy {fmt(e['range_copy_s'])})"
                          for n, e in ra["per_N"].items())
        log(f"  [info] of the restore, the load task alone (medians, Range adapter / resp adapter; then LMCache's L1 "
            f"allocation and the shim's copy in the Range row, which the adapter does not do): {split}; the Range "
            f"adapter's load max/min across N = {fmt(ra.get('load_max_over_min'))}")
    dr = acc["range_dram_vs_resident"]
    cells = ", ".join(f"C={c}: {e['ratio']:.2f}" for c, e in dr["per_chunk_tokens"].items())
    log(f"  [{'PASS' if dr['holds'] else 'FAIL'}] Range-DRAM / resident (<= 1.25 at every N): {cells or 'no data'}")
    log("=" * 118)


def plot(doc: dict[str, Any], png: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc} (pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(11, 5.5))
    paths: list[str] = []
    for r in doc["rows"]:
        if r["path"] not in paths:
            paths.append(r["path"])
    for p in paths:
        pts = sorted((r["num_objects"], r["restore_s_median"]) for r in doc["rows"]
                     if r["path"] == p and r.get("status") == "ok" and r.get("restore_s_median"))
        if not pts:
            continue
        style = "-o" if p.startswith("range_") else ("--s" if p.startswith("lmcache_") else ":^")
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=p, linewidth=2 if p.startswith("range") else 1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N = logical objects (chunks x layers) for the same payload")
    ax.set_ylabel("restore time, median (s)")
    cfg = doc["config"]
    ax.set_title(f"Restore of {cfg['payload_bytes'] / MIB:.0f} MiB of KV vs object count ({doc['machine']['cpu_count']} "
                 f"cores, load {doc['machine']['loadavg'][0]})")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return str(png)
