"""From a job's record to the grid's rows: measured and theoretical figures, speed-ups against dense
and fp16, the medians of repeated runs, auto against the fastest fixed mode, time to target."""
import re
import statistics

from bench.constants import AUTO_MODE
from bench.grid import EXAMPLES
from bench.linkbytes import measure, scheme_of, theoretical_bytes
from hvd_topk.auto.plans import TRANSPORTS

def steps_row(row, record, o, cp):
    """Fill a steps-part row with the measured and theoretical figures."""
    row.update(record_fields(record))
    try:
        row.update(measure(record, row["warmup"], o.min_measured))
    except ValueError as e:
        row.update(status="failed", error=str(e))
        return row
    scheme = scheme_of(record)
    stats = record.get("hvd_topk_stats") or {}
    ratio = stats.get("density") or record.get("ratio") or 1.0      # the ratio in use at the end
    mix = ", ".join(f"{t} {stats[f'auto_{t}']}" for t in TRANSPORTS if stats.get(f"auto_{t}"))
    row["scheme"] = scheme or (f"auto mix: {mix}" if mix else "")
    # split_reduce: rows kept over all owners and the largest owner's share over the mean, last step
    row.update({k: stats[k] for k in ("split_kept", "split_imbalance") if stats.get(k) is not None})
    if scheme is not None:
        theo = theoretical_bytes(scheme, record["tensors"], record["min_numel"], ratio, record["ranks"],
                                 value_bytes=2 if record.get("value_dtype") == "float16" else 4)
        row.update(theoretical_bytes=theo, measured_over_theoretical=row["link_bytes"] / theo if theo else None,
                   excess_bytes=row["link_bytes"] - theo)
    rate = cp.get((record["ranks"], row["bandwidth"], row["cycle_ms"]))
    if rate is not None:
        row.update(cp_idle_bytes_per_s_per_rank=rate, cp_bound_bytes=rate * row["step_s"])
    return row



def record_fields(record):
    """The run's own figures kept in every CSV row."""
    return {k: record.get(k) for k in ("model", "dataset", "num_params", "min_numel", "steps", "wall_s",
                                       "params_identical", "test_loss", "test_accuracy", "compression",
                                       "communication")}


def add_relative(rows):
    """Speed-up over dense and fp16 and bytes relative to them, within each (example, ranks, link, cycle,
    repeat)."""
    base = {}
    for r in rows:
        if r["status"] == "ok" and r["label"] in ("dense", "fp16") and "step_s" in r:
            base[(r["example"], r["ranks"], r["bandwidth"], r["cycle_ms"], r.get("repeat", 0), r["label"])] = r
    for r in rows:
        if r["status"] != "ok" or "step_s" not in r:
            continue
        for ref in ("dense", "fp16"):
            b = base.get((r["example"], r["ranks"], r["bandwidth"], r["cycle_ms"], r.get("repeat", 0), ref))
            if b is not None:
                r[f"speedup_vs_{ref}"] = b["step_s"] / r["step_s"]
                r[f"bytes_vs_{ref}"] = r["link_bytes"] / b["link_bytes"]
    return rows


# Figures of a steps row whose median over the repeats is the cell's (``median_rows``).
MEDIAN_FIELDS = ("measured_steps", "step_s", "step_s_p10", "step_s_p90", "link_bytes", "theoretical_bytes",
                 "measured_over_theoretical", "excess_bytes", "cp_bound_bytes", "split_kept", "split_imbalance",
                 "wall_s", "job_s")


def median_rows(rows):
    """One row per cell (example, ranks, link, cycle, mode, ratio) from the runs of every repeat: the
    median of each figure in ``MEDIAN_FIELDS`` over the runs that succeeded (``repeats`` of them; each
    one's step time in ``step_s_runs``); speed-ups and bytes against dense and fp16 are recomputed from
    the medians. A cell with no successful run keeps its first run's failure."""
    cells = {}
    for r in rows:
        cells.setdefault((r["example"], r["ranks"], r["bandwidth"], r["cycle_ms"], r["label"], r.get("ratio")),
                         []).append(r)
    out = []
    for runs in cells.values():
        ok = [r for r in runs if r["status"] == "ok" and "step_s" in r]
        row = {k: v for k, v in (ok or runs)[0].items() if not k.startswith(("speedup_vs_", "bytes_vs_"))}
        row.update(run_id=re.sub(r"-rep\d+$", "", row["run_id"]), repeat=0, repeats=len(ok))
        if ok:
            for field in MEDIAN_FIELDS:
                values = [r[field] for r in ok if r.get(field) is not None]
                row[field] = statistics.median(values) if values else None
            row.update(step_s_runs="/".join(f"{r['step_s'] * 1e3:.1f}" for r in ok),
                       scheme=", ".join(dict.fromkeys(r.get("scheme") or "" for r in ok)),
                       params_identical=all(r.get("params_identical") for r in ok),
                       error="; ".join(f"{r['run_id']}: {r['status']}" for r in runs if r not in ok))
        out.append(row)
    return add_relative(out)


def bytes_by_ranks(rows):
    """Link bytes against the rank count: the ok steps rows of every (example, link, cycle, mode, ratio)
    run at two rank counts or more, sorted by ranks, each with ``growth`` and ``theoretical_growth``:
    its measured and theoretical bytes over those of the same cell at the fewest ranks. Returns a list
    of (key, rows) in the rows' order."""
    cells = {}
    for r in rows:
        if r["status"] == "ok" and r.get("link_bytes") is not None:
            key = (r["example"], r["bandwidth"], r["cycle_ms"], mode_name(r))
            cells.setdefault(key, {})[r["ranks"]] = r      # medians: one row per rank count
    out = []
    for key, by_ranks in cells.items():
        if len(by_ranks) < 2:
            continue
        ordered = [dict(by_ranks[n]) for n in sorted(by_ranks)]
        base = ordered[0]
        for r in ordered:
            r["growth"] = r["link_bytes"] / base["link_bytes"] if base["link_bytes"] else None
            r["theoretical_growth"] = (r["theoretical_bytes"] / base["theoretical_bytes"]
                                       if r.get("theoretical_bytes") and base.get("theoretical_bytes") else None)
        out.append((key, ordered))
    return out


def auto_vs_best(rows):
    """Every ``hvd_topk auto`` run against the fastest fixed mode (any other mode, at auto's ratio or
    uncompressed) and against dense of the same example, ranks, link, cycle time and repeat."""
    ok = [r for r in rows if r["status"] == "ok" and "step_s" in r]

    def cell(r):
        return r["example"], r["ranks"], r["bandwidth"], r["cycle_ms"], r.get("repeat", 0)

    out = []
    for a in ok:
        if a["label"] != AUTO_MODE:
            continue
        fixed = [r for r in ok if r["label"] != AUTO_MODE and cell(r) == cell(a)
                 and r.get("ratio") in (None, a.get("ratio"))]
        if not fixed:
            continue
        best = min(fixed, key=lambda r: r["step_s"])
        dense = next((r for r in fixed if r["label"] == "dense"), None)
        out.append({"example": a["example"], "ranks": a["ranks"], "bandwidth": a["bandwidth"],
                    "cycle_ms": a["cycle_ms"], "repeat": a.get("repeat", 0), "ratio": a.get("ratio"),
                    "auto_s": a["step_s"], "best": mode_name(best), "best_s": best["step_s"],
                    "vs_best": a["step_s"] / best["step_s"] - 1,
                    "vs_dense": None if dense is None else a["step_s"] / dense["step_s"] - 1})
    return out



def tta_row(row, record, o):
    """Fill a tta row: final metric, time to the target; returns (row, curve points)."""
    row.update(record_fields(record))
    metric = EXAMPLES[row["example"]].metric
    target = o.tta_target[row["example"]]
    reached = [c["wall_s"] for c in record["curve"] if c.get(metric) is not None
               and (c[metric] >= target if metric == "test_acc" else c[metric] <= target)]
    row.update(final_metric=record["curve"][-1][metric] if record["curve"] else None, target=target,
               time_to_target_s=reached[0] if reached else None)
    points = [{"run_id": row["run_id"], "label": row["label"], "bandwidth": row["bandwidth"], **c}
              for c in record["curve"]]
    return row, points


def add_vs_dense_accuracy(rows):
    """Accuracy difference (points, as a fraction) or relative loss difference against dense."""
    dense = {(r["example"], r["non_iid"]): r for r in rows if r["status"] == "ok" and r["label"] == "dense"}
    for r in rows:
        d = dense.get((r["example"], r["non_iid"]))
        if r["status"] != "ok" or d is None:
            continue
        if EXAMPLES[r["example"]].metric == "test_acc":
            r["vs_dense"] = r["test_accuracy"] - d["test_accuracy"]
        else:
            r["vs_dense"] = r["test_loss"] / d["test_loss"] - 1.0
    return rows



def mode_name(r):
    """A row's mode and ratio, e.g. 'hvd_topk artopk 0.01'."""
    return r["label"] + ("" if r.get("ratio") in (None, "") else f" {r['ratio']:g}")

