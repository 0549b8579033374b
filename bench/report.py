"""The report of a run, into its results folder: every run writes the same files.

- ``records.json``: what the ranks recorded, one record per seed (every step time, turn, curve and
  stats); ``python -m bench report DIR`` rebuilds the rest from it;
- ``summary.json``: every figure (``bench.figures.summarize``);
- ``table.md``: the setup, one row per arm, the fastest arm to each target, the stats and the curves;
- ``curves.png`` (the test figure against training seconds) and ``steps.png`` (median step and bytes
  per rank per step);
- ``headline.json``: the run's few headline figures, the rows docs/results.md's summary table is
  generated from: ``{"title", "date", "page", "rows": [{"measure", "value", "setup"}]}``;
- ``manifest.json`` (``bench.manifest``: commit, command, date, machine), written first by the caller.
"""
import datetime
import json
import os

import matplotlib

matplotlib.use("Agg")               # files only, no display
import matplotlib.pyplot as plt     # noqa: E402

from bench.figures import summarize  # noqa: E402
from bench.links import HOROVOD_DEFAULT_CYCLE_MS, RATE_BYTES_PER_S  # noqa: E402

__all__ = ["write", "table", "headline", "cycle_text", "setup_text"]


def write(out, records, command, targets=(), title=None, page=None, load=None):
    """All the files but the manifest, from ``records``; returns the summary."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "records.json"), "w") as f:
        json.dump({"command": command, "targets": list(targets), "title": title, "page": page, "load_avg": load,
                   "records": records}, f)
    summary = dict(summarize(records, targets), command=command, load_avg=load)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table(summary, records))
    with open(os.path.join(out, "headline.json"), "w") as f:
        json.dump(headline(summary, title, page, _run_date(out)), f, indent=1, ensure_ascii=False)
        f.write("\n")
    plot_curves(records, summary, os.path.join(out, "curves.png"))
    plot_steps(summary, os.path.join(out, "steps.png"))
    return summary


def _run_date(out):
    """The day the run started (its manifest's, written first), so that a run past midnight is dated
    as its folder is; today's date where there is no manifest yet."""
    try:
        with open(os.path.join(out, "manifest.json")) as f:
            return str(json.load(f)["date"])[:10]
    except (OSError, KeyError, ValueError):
        return None


def rebuild(out):
    """``write`` again from ``out``/records.json (the manifest stays as the run wrote it)."""
    with open(os.path.join(out, "records.json")) as f:
        saved = json.load(f)
    return write(out, saved["records"], saved["command"], saved["targets"], saved["title"], saved["page"],
                 saved.get("load_avg"))


def cycle_text(cycle_ms):
    return f"{HOROVOD_DEFAULT_CYCLE_MS:g} ms (Horovod's default)" if cycle_ms is None else f"{cycle_ms:g} ms"


def setup_text(s):
    """One line: the task, ranks, link and where the bytes were counted."""
    where = (f"{s['hosts']} emulated hosts x {s['ranks'] // s['hosts']} ranks" if s["hosts"] else f"{s['ranks']} ranks")
    return f"{s['task']}, {where}, {s['link']} {'eth0' if s['hosts'] else 'loopback'}"


def _n(value, spec=",.1f", none="-"):
    return none if value is None else format(value, spec)


def _reached(t):
    if t["train_s"] is not None:
        return f"{t['train_s']:,.1f} s ({t['steps']:g})"
    return "not reached" if t["reached"].startswith("0/") else f"reached by {t['reached']} seeds"


def table(summary, records):
    """table.md's text."""
    s, metric = summary["setup"], summary["setup"]["metric"]
    names = [t["name"] for t in summary["targets"]]
    L = [f"# {s['task']}: {len(summary['arms'])} arms side by side in one job", "",
         f"{setup_text(s)}; Horovod cycle time {cycle_text(s['cycle_ms'])}; launcher {s['launcher']}"
         f"{'; ' + ' '.join(s['env']) if s['env'] else ''}. {s['steps']} steps per arm (warm-up {s['warmup']} alone, "
         f"then turns of {s['turn']}), {metric} every {s['eval_every']} steps, batch {s['batch_size']} per rank, "
         f"ratio {s['ratio']:g}, seeds {s['seeds']}{', non-IID' if s['non_iid'] else ''}. Step: rank 0, zero_grad "
         "to the end of step, median (p10-p90) over the turns. Bytes: the interface's tx per rank per step, "
         "median over the turns (theoretical: what the scheme must send). Time to a target: the training "
         "seconds (steps) at the first evaluation that reached it, median over the seeds.", "",
         f"Command: `{summary['command']}`", "",
         "| arm | step ms (p10-p90) | bytes/rank/step | theoretical | vs ref: speed-up, bytes | final "
         f"{metric} | " + " | ".join(names) + " | same params |",
         "|---|---|---:|---:|---|---:|" + "---:|" * len(names) + "---|"]
    for name, a in summary["arms"].items():
        final = a["final_loss"] if metric == "loss" else a["final_accuracy"]
        vs = f"{a['speedup']:.2f}x, {a['bytes_vs_reference']:.3g}x" if "speedup" in a else "-"
        L.append(f"| {name} | {_n(a['step_ms'])} ({_n(a['step_ms_p10'])}-{_n(a['step_ms_p90'])}) | "
                 f"{_n(a['bytes'], ',.0f')} | {_n(a.get('theoretical_bytes'), ',.0f')} | {vs} | {_n(final, '.4f')} | "
                 + " | ".join(_reached(a["targets"][n]) for n in names)
                 + f" | {_same(a)} |")
    L += ["", f"Reference: {summary['reference'] or 'none (no dense arm)'}. Fastest to each target:", ""]
    L += [f"- {n}: {w or 'no arm reached it'}" for n, w in summary["fastest"].items()]
    if summary["auto"]:
        a = summary["auto"]
        dense = "-" if a["vs_dense"] is None else f"{100 * a['vs_dense']:+.1f}%"
        verdict = "no data" if a["met"] is None else "met" if a["met"] else "not met"
        L += ["", f"hvd_topk auto against the fastest fixed transport ({a['fastest_fixed']}): "
              f"{100 * a['vs_fastest']:+.1f}%; against dense: {dense}; target (within 5% of "
              f"{'dense' if s['link'] == 'unlimited' else 'the fastest'}): {verdict}."]
    L += _bound_lines(summary) + _stats_lines(summary) + ["", f"Curves (steps: {metric}, seed {s['seeds'][0]}):", ""]
    for name, arm in records[0]["arms"].items():
        L.append(f"- {name}: " + ", ".join(f"{c[0]}: {c[3] if metric == 'loss' else c[2]:.3f}" for c in arm["curve"]))
    load = summary.get("load_avg") or []
    if load:
        L += ["", f"Load average (1 min) during the job: {min(load):.1f}-{max(load):.1f} ({len(load)} samples); "
              f"seeds {', '.join(f'{j:.0f}' for j in s['seed_s'] if j)} s."]
    return "\n".join(L) + "\n"


def _same(arm):
    """The "same params" cell; the compute-only arm's ranks drift apart by design."""
    if arm["kind"] == "local":
        return "- (no exchange)"
    return "yes" if arm["params_identical"] else "NO"


def _bound_lines(summary):
    """Each arm's step over its bound, where the run has the ``compute only`` arm and a limited link: that
    arm's step plus the seconds the arm's bytes take on one link (bytes per rank x the ranks behind that
    link / its rate: a host's eth0, or the one loopback every rank shares)."""
    s, local = summary["setup"], summary["arms"].get("compute only")
    rate = RATE_BYTES_PER_S.get(s["link"])
    if not rate or not local or not local["step_ms"]:
        return []
    behind = s["ranks"] / (s["hosts"] or 1)
    lines = ["", f"Step over its bound: the compute-only step ({local['step_ms']:.1f} ms) plus the arm's bytes on "
             f"one {'host' if s['hosts'] else 'loopback'}'s {s['link']} link ({behind:g} ranks' bytes per rank):", ""]
    for name, a in summary["arms"].items():
        if a["kind"] != "local" and a["step_ms"] and a["bytes"]:
            link_ms = 1e3 * a["bytes"] * behind / rate
            lines.append(f"- {name}: {a['step_ms']:.1f} / ({local['step_ms']:.1f} + {link_ms:.1f}) ms = "
                         f"{a['step_ms'] / (local['step_ms'] + link_ms):.2f}x")
    return lines


def _stats_lines(summary):
    """The optimizers' own per-step figures (``stats()``), medians after the warm-up, as reported."""
    arms = {n: a["stats"] for n, a in summary["arms"].items() if a["stats"]}
    keys = list(dict.fromkeys(k for st in arms.values() for k in st))
    if not keys:
        return []
    lines = ["", "The optimizers' stats() (median per step after the warm-up; *_s in seconds):", "",
             "| arm | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for name, st in arms.items():
        lines.append(f"| {name} | " + " | ".join(_n(st.get(k), ".4g") for k in keys) + " |")
    return lines


def headline(summary, title=None, page=None, date=None):
    """The run's headline figures: each arm's median step and bytes against the reference's (without
    one: each arm's own), and the arms' time to the first relative target (else the first fixed one)."""
    s, ref = summary["setup"], summary["reference"]
    arms = summary["arms"]
    setup = f"{setup_text(s)}, cycle {cycle_text(s['cycle_ms'])}"
    rows = []
    for name, a in arms.items():
        if "speedup" in a:
            rows.append({"measure": f"{name} vs {ref}: median step / bytes per rank per step",
                         "value": f"{a['step_ms']:,.1f} vs {arms[ref]['step_ms']:,.1f} ms (speed-up {a['speedup']:.2f}x)"
                                  f" / {a['bytes_vs_reference']:.3g}x the bytes", "setup": setup})
        elif name != ref and a["step_ms"] is not None:
            rows.append({"measure": f"{name}: median step / bytes per rank per step",
                         "value": f"{a['step_ms']:,.1f} ms / {_n(a['bytes'], ',.0f')} B", "setup": setup})
    targets = [t["name"] for t in summary["targets"]]
    target = next((t for t in targets if ref and t.startswith(ref)), targets[0] if targets else None)
    if target:
        times = [(a["targets"][target]["train_s"], n) for n, a in arms.items()]
        rows.append({"measure": f"Training time to {target}, each arm",
                     "value": ", ".join(f"{n} {'not reached' if t is None else f'{t:,.1f} s'}" for t, n in times),
                     "setup": setup})
    return {"title": title or f"{', '.join(arms)} side by side in one job: {setup_text(s)}",
            "date": date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "page": page,
            "rows": rows}


def plot_curves(records, summary, path):
    """The test figure of every arm against its training seconds (every seed; the first one solid)."""
    metric = summary["setup"]["metric"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, name in enumerate(records[0]["arms"]):
        for j, record in enumerate(records):
            pts = [(c[1], c[3] if metric == "loss" else c[2]) for c in record["arms"][name]["curve"]]
            if pts:
                ax.plot(*zip(*pts), color=f"C{i % 10}", marker="." if j == 0 else None, alpha=1.0 if j == 0 else 0.4,
                        label=name if j == 0 else None)
    ax.set_xlabel("training seconds (rank 0's step times)")
    ax.set_ylabel(f"test {metric}")
    ax.set_title(setup_text(summary["setup"]), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_steps(summary, path):
    """Median step (p10-p90 whiskers) and bytes per rank per step of every arm."""
    names = list(summary["arms"])
    arms = [summary["arms"][n] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(7.0, 1.1 * len(names) + 3), 4.2))
    med = [a["step_ms"] or 0 for a in arms]
    err = [[m - (a["step_ms_p10"] or m) for m, a in zip(med, arms)], [(a["step_ms_p90"] or m) - m for m, a in zip(med, arms)]]
    left.bar(range(len(names)), med, yerr=err, color=[f"C{i % 10}" for i in range(len(names))])
    left.set_ylabel("median step, ms (p10-p90)")
    right.bar(range(len(names)), [a["bytes"] or 0 for a in arms], color=[f"C{i % 10}" for i in range(len(names))])
    right.set_yscale("log")
    right.set_ylabel("bytes per rank per step")
    for ax in (left, right):
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=7)
    fig.suptitle(setup_text(summary["setup"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
