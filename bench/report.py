"""The grid's outputs: CSV files, the targets check list and report.md, built from the collected rows.

``build_outputs`` is the entry point (also for ``--report-only``, from the saved raw records).
"""
import csv
import os
import platform
import statistics

from hvd_topk.auto.plans import TRANSPORTS

from bench.constants import AUTO_MODE, BANDWIDTHS
from bench.grid import EXAMPLES, is_sparse, mode_warmup
from bench.plots import plot_all
from bench.rows import (add_relative, add_vs_dense_accuracy, auto_vs_best, bytes_by_ranks, median_rows, mode_name,
                        record_fields, steps_row, tta_row)

STEPS_COLUMNS = ["run_id", "status", "example", "model", "label", "compression", "communication", "scheme",
                 "ratio", "ranks", "bandwidth", "burst", "cycle_ms", "repeat", "repeats", "num_params", "steps",
                 "measured_steps", "step_s", "step_s_runs", "step_s_p10", "step_s_p90", "speedup_vs_dense",
                 "speedup_vs_fp16", "link_bytes", "theoretical_bytes", "measured_over_theoretical", "excess_bytes",
                 "cp_idle_bytes_per_s_per_rank",
                 "cp_bound_bytes", "bytes_vs_dense", "bytes_vs_fp16", "split_kept", "split_imbalance",
                 "params_identical",
                 "test_accuracy", "test_loss", "wall_s", "job_s", "est_s", "command", "error"]
CP_COLUMNS = ["ranks", "bandwidth", "cycle_ms", "idle_s", "measured_s", "tx_bytes", "bytes_per_s",
              "bytes_per_s_per_rank", "allreduce_op_bytes", "broadcast_op_bytes", "status", "error"]
TTA_COLUMNS = ["run_id", "status", "example", "model", "label", "ratio", "ranks", "bandwidth", "budget_s",
               "eval_every", "steps", "wall_s", "final_metric", "time_to_target_s", "target", "params_identical",
               "test_accuracy", "test_loss", "job_s", "command", "error"]
ACC_COLUMNS = ["run_id", "status", "example", "model", "label", "ratio", "ranks", "non_iid", "steps",
               "test_accuracy", "test_loss", "vs_dense", "params_identical", "wall_s", "job_s", "command", "error"]


def write_csv(path, rows, columns):
    """Rows as CSV with the given columns (missing values empty, floats with 6 significant digits)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if r.get(c) is None else (f"{r[c]:.6g}" if isinstance(r[c], float) else r[c])
                        for c in columns])


def _failed_row(lead, r, cells, limit=100):
    """Markdown row of a run that did not finish: ``lead`` cells, its status and error, then empty
    cells up to ``cells`` columns."""
    return "| " + " | ".join([*lead, f"{r['status']}: {r['error'][:limit]}"]) + " |" + " |" * (cells - len(lead) - 1)


def fmt_number(v, spec=",.0f", suffix=""):
    return "-" if v is None or v == "" else format(v, spec) + suffix


def checks(steps, acc, runs=None):
    """The targets: list of (target, met: True/False/None for no data, numbers). ``steps`` are the
    cells (medians when the grid was repeated), ``runs`` every repeat's runs (or None)."""
    out = []
    ok = [r for r in steps if r["status"] == "ok" and "link_bytes" in r]
    comp = [r for r in ok if r.get("ratio") is not None and r.get("measured_over_theoretical")]
    if comp:
        worst = max(comp, key=lambda r: r["measured_over_theoretical"])
        bad = [r for r in comp if r["measured_over_theoretical"] > 1.1]
        by_ratio = "; ".join(
            f"ratio {ratio:g}: {min(q):.2f}-{max(q):.2f}" for ratio in sorted({r["ratio"] for r in comp}, reverse=True)
            for q in [[r["measured_over_theoretical"] for r in comp if r["ratio"] == ratio]])
        out.append(("(1) measured/theoretical <= 1.1 for every compressed mode", not bad,
                    f"{len(comp) - len(bad)}/{len(comp)} runs within 1.1; worst "
                    f"{worst['measured_over_theoretical']:.2f} ({mode_name(worst)}, {worst['ranks']} ranks, "
                    f"{worst['bandwidth']}); range by ratio: {by_ratio}"))
    else:
        out.append(("(1) measured/theoretical <= 1.1 for every compressed mode", None, "no data"))
    for label, bound in (("hvd_topk allgather", 25), ("hvd_topk allgather fp16", 25), ("hvd_topk artopk", 40),
                         ("topkef", 40)):
        rs = [r for r in ok if r["label"] == label and r["ranks"] == 4 and r.get("ratio") == 0.01
              and r.get("bytes_vs_dense")]
        text = "; ".join(f"{r['bandwidth']}: 1/{1 / r['bytes_vs_dense']:.1f}" for r in rs)
        out.append((f"(2) 4 ranks, ratio 0.01: {label} link bytes <= 1/{bound} of dense",
                    all(1 / r["bytes_vs_dense"] >= bound for r in rs) if rs else None, text or "no data"))
    big = [r for r in ok if r["ranks"] == 4 and r["bandwidth"] == "100mbit" and r.get("ratio") == 0.01
           and (r.get("num_params") or 0) >= 5e6]
    for r in big:
        sd, sf = r.get("speedup_vs_dense"), r.get("speedup_vs_fp16")
        met = None if sd is None or sf is None else (sd >= 5 and sf >= 2.5)
        out.append((f"(3) 100 Mbit, 4 ranks, {r['num_params'] / 1e6:.1f}M params: {mode_name(r)} step >= 5x "
                     "faster than dense, >= 2.5x than fp16", met,
                     f"{fmt_number(sd, '.2f', 'x')} vs dense, {fmt_number(sf, '.2f', 'x')} vs fp16"))
    if not big:
        out.append(("(3) 100 Mbit, 4 ranks, >= 5M params: >= 5x dense, >= 2.5x fp16", None, "no data"))
    acc_ok = [r for r in acc if r["status"] == "ok" and r.get("vs_dense") is not None]
    for r in acc_ok:
        if r["non_iid"] or not is_sparse(r["label"]):
            continue
        if EXAMPLES[r["example"]].metric == "test_acc":
            met = r["vs_dense"] >= -0.01
            text = f"{r['test_accuracy']:.4f} vs dense {r['test_accuracy'] - r['vs_dense']:.4f}"
            name = f"(4) {r['example']} accuracy within 1 point of dense: {mode_name(r)}"
        else:
            met, text = r["vs_dense"] <= 0.02, f"loss {r['test_loss']:.4f}, {100 * r['vs_dense']:+.2f}% vs dense"
            name = f"(4) {r['example']} loss within 2% of dense: {mode_name(r)}"
        out.append((name, met, text))
    noniid = [r for r in acc_ok if r["non_iid"]]
    out.append(("(4) non-IID reported", bool(noniid) if acc else None,
                f"{len(noniid)} non-IID runs in the accuracy table" if acc else "no data"))
    per_repeat = auto_vs_best(runs or [])
    for c in auto_vs_best(steps):
        # The target: on the emulated (tbf) links, within 5% of the best fixed mode; on the unlimited
        # loopback, within 5% of dense (its figure against the best fixed mode is given too).
        unlimited = c["bandwidth"] == "unlimited"
        key = "vs_dense" if unlimited else "vs_best"
        met = None if c[key] is None else c[key] <= 0.05
        text = (f"auto {c['auto_s'] * 1e3:,.1f} ms, best fixed {c['best']} {c['best_s'] * 1e3:,.1f} ms: "
                f"{100 * c['vs_best']:+.1f}%")
        if unlimited:
            text += f"; vs dense {fmt_number(None if c['vs_dense'] is None else 100 * c['vs_dense'], '+.1f', '%')}"
        same = [x for x in per_repeat if (x["example"], x["ranks"], x["bandwidth"], x["cycle_ms"], x["ratio"])
                == (c["example"], c["ranks"], c["bandwidth"], c["cycle_ms"], c["ratio"])]
        if same:
            text += (f" (medians of {len(same)} repeats; each repeat vs "
                     + ("dense" if unlimited else "its best fixed mode") + ": "
                     + ", ".join(fmt_number(None if x[key] is None else 100 * x[key], '+.1f', '%') for x in same) + ")")
        out.append((f"(auto) {c['ranks']} ranks, {c['bandwidth']}, ratio {c['ratio']:g}: auto within 5% of "
                    + ("dense" if unlimited else "the best fixed mode"), met, text))
    return out


def machine_facts():
    """Cores, CPU, kernel and versions, as markdown lines."""
    import horovod
    import torch
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return [f"- CPU: {os.cpu_count()} cores visible ({cpu or 'unknown model'}); Linux {platform.release()}",
            f"- Python {platform.python_version()}, torch {torch.__version__}, horovod {horovod.__version__} (Gloo)"]


def _cycle_summary(cycle):
    """One line per mode: its excess bytes at the shortest and the longest cycle time of the cycle part."""
    out = []
    ok = [r for r in cycle if r["status"] == "ok" and r.get("excess_bytes") is not None]
    for name in dict.fromkeys(mode_name(r) for r in ok):
        rs = sorted((r for r in ok if mode_name(r) == name), key=lambda r: float(r["cycle_ms"]))
        if len(rs) > 1:
            lo, hi = rs[0], rs[-1]
            out.append(f"- {name}: excess {lo['excess_bytes']:,.0f} B at {lo['cycle_ms']} ms, "
                       f"{hi['excess_bytes']:,.0f} B at {hi['cycle_ms']} ms; step {lo['step_s'] * 1e3:,.0f} ms "
                       f"vs {hi['step_s'] * 1e3:,.0f} ms")
    return out


def notes(o):
    """The report's notes: what the ratio includes, and why the settings are what they are."""
    return [
        "## Notes: what the numbers include", "",
        "- **measured / theoretical.** Measured: the loopback's transmitted bytes over the measured steps, every "
        "rank's together, divided by steps and ranks: payload, TCP/IP headers and ACKs, Gloo's per-message "
        "preambles and its 'send ready' / 'recv ready' notifications, and Horovod's control plane (a coordination "
        "allreduce every cycle, also while the step computes). Theoretical: the payload the scheme must move "
        "(`bench.evidence.theoretical_bytes`). excess = measured - theoretical: all of the overhead, measured. "
        "control plane <=: the probe's idle rate for the same ranks and link times the step time, an upper "
        "bound on the cycles' share: idle ranks cycle at the full rate, ranks busy computing (more ranks than "
        "cores) cycle far less often. Part `cycle` shows how much of the excess follows the cycle time.",
        "- **Theoretical bytes per rank per step** (Horovod 0.28.1's Gloo: ring allreduce, binomial-tree "
        "broadcast, ring allgatherv; see `theoretical_bytes`), N ranks, k = max(1, ceil(ratio * numel)) per "
        "compressed tensor, dense tensors 2(N-1)/N * 4 * numel: dense 2(N-1)/N * 4 * numel; fp16 2(N-1)/N * 2 "
        "* numel; topkef and artopk 2(N-1)/N * 4(k+1) + (N-1)/N * 4k (values + flag allreduced, the leader's "
        "int32 index set shared: (N-1) * 4k on the link, averaged over the ranks, whether broadcast or, since "
        "one allgather per step carries every set, forwarded around the ring); allgather (N-1) * 8(k+1); "
        "split_reduce 8((N-1)/N * k + N-1) (alltoall of the top-k rows of value + int32 index to their "
        "region's owner and a flag row to every rank) + 2(N-1)/N * 516 (histogram allreduce) + 8(N-1)/N * "
        "(k + N) (allgatherv of the at most k kept rows and a padding row per owner: a bound); "
        "with float16 values (mode 'hvd_topk allgather fp16', `value_dtype=torch.float16`) a compressed "
        "tensor's values and flag take 2 bytes instead of 4 (allgather (N-1) * 6(k+1)).",
        "- **Step windows.** Each step's bytes are counted from the previous step's end to its own end on "
        "rank 0, so an asynchronous transfer (the next step's index sets) can land in a neighbouring "
        "window: the measured sum is off by up to about one step's index sets, a share 1/M of it over M "
        "measured steps (values slightly under 1.0 at ratio 0.1 come from this).",
        "- **Where the overhead comes from.** Every collective has a fixed cost in messages (probe table: a "
        "small broadcast costs a few KB over all ranks, more than a small allreduce), and the layer-wise "
        "transports run allreduces (fused per cycle) and, for the AR-Topk index sets, one allgather per step; "
        "the control plane adds a little per cycle. At ratio 0.001 the payload of this 6.3M-parameter model is "
        "tens of KB per rank per step, the same order as those fixed costs, so the ratio stays well above "
        "1.1 there; at 0.1 and 0.01 the payload dwarfs them. Fewer, larger collectives (hvd_topk's "
        "`--selection global`) lower the fixed part; "
        "none of this changes what the scheme itself must send.",
        f"- **HOROVOD_CYCLE_TIME={o.cycle_time_ms} ms.** Horovod 0.28.1 defaults to 1 ms. The grid sets one value "
        "for every job, dense and fp16 included: a ready tensor waits at most one cycle longer, which costs a "
        "network-bound step little, and the control plane shrinks in proportion. How much that matters depends "
        "on the machine: cycles run while ranks wait (for the link or for a core), so a loaded machine showed "
        "more of them than an idle one (`--part cycle` measures bytes and step time side by side).",
        "- **Allgather at 4 ranks, ratio 0.01.** Its theoretical bytes over dense are N(k+1)/numel = 0.04 = 1/25 "
        "before any overhead, so 'at most 1/25 of dense' can only hold if dense carried more overhead than it; "
        "with float16 values ('hvd_topk allgather fp16') it is 3/4 of that, 0.03 = 1/33.",
        "- **TopKEF vs hvd_topk.** TopKEF (stock Horovod's Compressor) compresses every tensor of at least "
        "min_numel elements, 1-D included; hvd_topk.DistributedOptimizer sends 1-D tensors dense.",
        f"- **auto.** Its first steps probe the link and may measure up to {1 + len(TRANSPORTS)} plans in turns of "
        "4 steps, for 5 to 21 rounds; its steps are measured after {mode_warmup(AUTO_MODE)} warm-up steps, or after its trial "
        "when that takes longer. Its theoretical bytes are given when all "
        "its tensors use one transport (from `hvd_topk_stats`), else left empty.",
        "- **Time to accuracy.** The budget is checked at step boundaries, so a run's last step can end past it "
        "(one dense step at 100 Mbit with 4 ranks is ~12 s). Evaluation time is not on the clock.",
        f"- **Link model.** tbf with burst {o.burst} (1mb is the smallest that passes MTU-9000 frames here): "
        "that much can pass at the loopback's speed after an idle moment, so short bursts beat the rate.",
    ]


def write_report(path, o, steps, cycle, cp, tta, acc, pngs, command, runs=None):
    """report.md: check list, setup, control plane, step tables (medians with ``runs``, every repeat's
    runs, after --repeats), repeats, TTA, accuracy, notes, commands."""
    L = (_head_section(o, steps, acc, command, runs) + _control_plane_section(cp) + _steps_section(steps)
         + _ranks_section(steps))
    if runs:
        L += _repeats_section(runs)
    L += _cycle_section(cycle)
    L += [f"![{title}]({png})\n" for png, title in (("bytes_per_step.png", "bytes per step"),
                                                    ("speedup.png", "speed-up over dense")) if png in pngs]
    L += _tta_section(o, tta, pngs) + _accuracy_section(acc)
    L += notes(o) + [""]
    L += ["## Commands of the runs", "", "<details><summary>every job's command line</summary>", "", "```"]
    L += [r.get("command", "") for r in (runs or steps) + tta + acc if r.get("command")]
    L += ["```", "", "</details>", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def _head_section(o, steps, acc, command, runs):
    """Markdown: the title, the targets check list and the setup."""
    L = ["# Evidence: step time, link bytes, time to accuracy and accuracy of Top-K compression", ""]
    L += ["## Targets", "", "| target | status | numbers |", "|---|---|---|"]
    for name, met, text in checks(steps, acc, runs):
        L.append(f"| {name} | {'met' if met else 'not met' if met is False else 'no data'} | {text} |")
    L += ["", "## Setup", ""] + machine_facts() + [
        f"- Links: every job in a fresh network namespace; loopback MTU 9000; `tc tbf rate R burst {o.burst} "
        "latency 100ms` for 100mbit and 1gbit, no qdisc for unlimited. All ranks share the one loopback, so a "
        "job's total traffic (every rank's) goes through the limit.",
        f"- Horovod: Gloo controller, `HOROVOD_CYCLE_TIME={o.cycle_time_ms}` (ms) for every job, dense and fp16 "
        "included; fusion threshold and response cache at Horovod's defaults (128 MiB, on).",
        f"- Steps part: {o.warmup} warm-up steps skipped, then {o.min_measured}..{o.max_measured} measured steps "
        "(fewer when a step is slow); step time = median of the measured steps; link bytes = sum of the "
        "measured steps' loopback tx bytes / steps / ranks."
        + (f" The grid ran {max(r['repeat'] for r in runs)} times in turn (every mode once per repeat); every "
           "figure of the step tables is the median over the repeats (each run's step time is in the Repeats "
           "section)." if runs else ""),
        f"- Command: `{command}`", ""]
    return L


def _control_plane_section(cp):
    """Markdown: the control-plane probes' table."""
    L = ["## Horovod's control plane and per-collective overhead (measured)", "",
          "A probe job per link: its ranks first sit idle between two barriers, yet bytes flow: the Gloo "
          "controller runs a cycle every HOROVOD_CYCLE_TIME, each with a small bit-vector allreduce "
          "(response-cache coordination). Then it runs one-element allreduces and broadcasts one at a time: "
          "the bytes one small collective costs beyond its payload (the idle rate over the same time "
          "subtracted): each Gloo message travels with 'send ready' / 'recv ready' notifications "
          "(48-byte preambles), each TCP segment with its headers, and a ring allreduce of N ranks sends "
          "at least 2N segments. Bytes of all ranks together.", "",
          "| ranks | link | cycle ms | idle bytes/s | idle bytes/s per rank | bytes per small allreduce | "
          "bytes per small broadcast |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in cp:
        L.append(f"| {r['ranks']} | {r['bandwidth']} | {r['cycle_ms']} | {fmt_number(r.get('bytes_per_s'))} | "
                 f"{fmt_number(r.get('bytes_per_s_per_rank'))} | {fmt_number(r.get('allreduce_op_bytes'))} | "
                 f"{fmt_number(r.get('broadcast_op_bytes'))} |" if r["status"] == "ok"
                 else f"| {r['ranks']} | {r['bandwidth']} | {r['cycle_ms']} | failed: {r['error'][:80]} | | | |")
    return L


def _steps_section(steps):
    """Markdown: step time and link bytes, one table per (ranks, link)."""
    L = ["", "## Step time and link bytes", "",
          "bytes: per rank per step. theoretical: what the scheme must send (`theoretical_bytes`, formulas "
          "verified in Horovod 0.28.1 / Gloo). ratio = measured / theoretical: it includes TCP/IP headers and "
          "ACKs, Gloo's per-message preamble and notifications, Horovod's control plane during the step, and "
          "everything else the job sent in the measured steps. excess = measured - theoretical. control plane <=: "
          "the probe's idle rate times the step time, an upper bound on the control plane's share (see the "
          "notes).", ""]
    for ranks in sorted({r["ranks"] for r in steps}):
        for bw in [b for b in BANDWIDTHS if any(r["bandwidth"] == b and r["ranks"] == ranks for r in steps)]:
            rs = [r for r in steps if r["ranks"] == ranks and r["bandwidth"] == bw]
            L += [f"### {ranks} ranks, {bw}", "",
                  "| mode | step ms | vs dense | vs fp16 | link bytes | theoretical | ratio | excess | "
                  "control plane <= | bytes vs dense | same params |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
            for r in rs:
                if r["status"] != "ok":
                    L.append(_failed_row([mode_name(r)], r, 11, limit=120))
                    continue
                L.append(f"| {mode_name(r)} | {r['step_s'] * 1e3:,.1f} | "
                         f"{fmt_number(r.get('speedup_vs_dense'), '.2f', 'x')} | "
                         f"{fmt_number(r.get('speedup_vs_fp16'), '.2f', 'x')} | {fmt_number(r['link_bytes'])} | "
                         f"{fmt_number(r.get('theoretical_bytes'))} | {fmt_number(r.get('measured_over_theoretical'), '.3f')} | "
                         f"{fmt_number(r.get('excess_bytes'))} | {fmt_number(r.get('cp_bound_bytes'))} | "
                         f"{fmt_number(r.get('bytes_vs_dense'), '.4f')} | "
                         f"{'yes' if r.get('params_identical') else 'NO'} |")
            L.append("")
    return L


def _ranks_section(steps):
    """Markdown: link bytes per rank per step against the rank count, per link (empty unless a mode ran
    at two rank counts or more)."""
    cells = bytes_by_ranks(steps)
    if not cells:
        return []
    L = ["## Link bytes against the rank count", "",
         "Per rank per step, measured and theoretical, for every mode run at several rank counts; growth: "
         "bytes over the same mode's at its fewest ranks (measured, and theoretical in brackets). More ranks "
         "than cores make steps slow, not bytes different: the table is bytes, not time. owners' imbalance "
         "(split_reduce): the largest owner's kept rows over the mean, last step.", ""]
    for bw in BANDWIDTHS:
        rows = [(key, rs) for key, rs in cells if key[1] == bw]
        if not rows:
            continue
        examples = sorted({key[0] for key, _ in rows})
        L += [f"### {bw}" + (f" ({', '.join(examples)})" if examples else ""), "",
              "| mode | ranks | link bytes | theoretical | measured/theoretical | growth | owners' imbalance |",
              "|---|---:|---:|---:|---:|---|---:|"]
        for (example, _, _, name), rs in rows:
            label = name if len(examples) == 1 else f"{name} ({example})"
            for r in rs:
                growth = ("-" if r.get("growth") is None else f"{r['growth']:.2f}x") + (
                    "" if r.get("theoretical_growth") is None else f" ({r['theoretical_growth']:.2f}x)")
                L.append(f"| {label} | {r['ranks']} | {fmt_number(r['link_bytes'])} | "
                         f"{fmt_number(r.get('theoretical_bytes'))} | "
                         f"{fmt_number(r.get('measured_over_theoretical'), '.3f')} | {growth} | "
                         f"{fmt_number(r.get('split_imbalance'), '.2f')} |")
        L.append("")
    return L


def _cycle_section(cycle):
    """Markdown: the cycle part's table and summary (empty without it)."""
    if not cycle:
        return []
    L = ["## Control plane against HOROVOD_CYCLE_TIME", "",
          "The same runs at several cycle times (the cycle part): a longer cycle means fewer "
          "coordination rounds per second (fewer control-plane bytes) but a longer wait before a ready "
          "tensor is sent.", "",
          "| cycle ms | mode | ranks | link | step ms | link bytes | theoretical | ratio | excess | "
          "control plane <= |", "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in cycle:
        if r["status"] != "ok":
            L.append(_failed_row([str(r["cycle_ms"]), mode_name(r), str(r["ranks"]), r["bandwidth"]], r, 10))
            continue
        L.append(f"| {r['cycle_ms']} | {mode_name(r)} | {r['ranks']} | {r['bandwidth']} | "
                 f"{r['step_s'] * 1e3:,.1f} | {fmt_number(r['link_bytes'])} | {fmt_number(r.get('theoretical_bytes'))} | "
                 f"{fmt_number(r.get('measured_over_theoretical'), '.3f')} | {fmt_number(r.get('excess_bytes'))} | "
                 f"{fmt_number(r.get('cp_bound_bytes'))} |")
    L += [""] + _cycle_summary(cycle) + [""]
    return L


def _tta_section(o, tta, pngs):
    """Markdown: time to accuracy (empty without the tta part)."""
    if not tta:
        return []
    L = ["## Time to accuracy", "",
          f"Every mode trains for the same wall-clock budget ({o.tta_budget:g} s of training; evaluation "
          "excluded from the clock). Target: the accuracy / loss named in the table.", "",
          "| example | link | mode | steps | final | time to target (s) | same params |",
          "|---|---|---|---:|---:|---:|:---:|"]
    for r in tta:
        if r["status"] != "ok":
            L.append(_failed_row([r["example"], r["bandwidth"], mode_name(r)], r, 7))
            continue
        L.append(f"| {r['example']} | {r['bandwidth']} | {mode_name(r)} | {r['steps']} | "
                 f"{fmt_number(r.get('final_metric'), '.4f')} | "
                 f"{fmt_number(r.get('time_to_target_s'), '.1f')} (target {r['target']:g}) | "
                 f"{'yes' if r.get('params_identical') else 'NO'} |")
    L.append("")
    L += [f"![time to accuracy, {p[4:-4]}]({p})" for p in pngs if p.startswith("tta_")] + [""]
    return L


def _accuracy_section(acc):
    """Markdown: accuracy after a fixed length (empty without the accuracy part)."""
    if not acc:
        return []
    L = ["## Accuracy after a fixed length (unlimited link)", "",
          "| example | data | mode | length | test accuracy | test loss | vs dense | same params |",
          "|---|---|---|---:|---:|---:|---:|:---:|"]
    for r in acc:
        if r["status"] != "ok":
            L.append(_failed_row([r["example"], "non-IID" if r["non_iid"] else "IID", mode_name(r)], r, 8))
            continue
        metric = EXAMPLES[r["example"]].metric
        vs = r.get("vs_dense")
        vs_text = "-" if vs is None else (f"{100 * vs:+.2f} pt" if metric == "test_acc" else f"{100 * vs:+.2f}%")
        L.append(f"| {r['example']} | {'non-IID' if r['non_iid'] else 'IID'} | {mode_name(r)} | {r['steps']} | "
                 f"{fmt_number(r.get('test_accuracy'), '.4f')} | {fmt_number(r.get('test_loss'), '.4f')} | {vs_text} | "
                 f"{'yes' if r.get('params_identical') else 'NO'} |")
    L.append("")
    return L


def _repeats_section(runs):
    """Markdown: each repeat's step time per cell, and auto against the best fixed mode per repeat."""
    n = max(r["repeat"] for r in runs)
    L = ["## Repeats", "", f"Step ms of every run; the grid ran {n} times in turn.", ""]
    for ranks in sorted({r["ranks"] for r in runs}):
        for bw in [b for b in BANDWIDTHS if any(r["bandwidth"] == b and r["ranks"] == ranks for r in runs)]:
            rs = [r for r in runs if r["ranks"] == ranks and r["bandwidth"] == bw]
            L += [f"### {ranks} ranks, {bw}", "", "| mode | " + " | ".join(f"run {i}" for i in range(1, n + 1))
                  + " | median |", "|---|" + "---:|" * (n + 1)]
            for name in dict.fromkeys(mode_name(r) for r in rs):
                times = {r["repeat"]: r["step_s"] for r in rs if mode_name(r) == name and r["status"] == "ok"
                         and "step_s" in r}
                cells = [f"{times[i] * 1e3:,.1f}" if i in times else "failed" for i in range(1, n + 1)]
                median = f"{statistics.median(times.values()) * 1e3:,.1f}" if times else "-"
                L.append(f"| {name} | " + " | ".join(cells) + f" | {median} |")
            L.append("")
    auto = auto_vs_best(runs)
    if auto:
        L += ["Auto against the fastest fixed mode of the same repeat:", "",
              "| ranks | link | ratio | run | auto ms | best fixed | its ms | auto vs best | auto vs dense |",
              "|---:|---|---:|---:|---:|---|---:|---:|---:|"]
        for c in auto:
            L.append(f"| {c['ranks']} | {c['bandwidth']} | {c['ratio']:g} | {c['repeat']} | {c['auto_s'] * 1e3:,.1f} | "
                     f"{c['best']} | {c['best_s'] * 1e3:,.1f} | {100 * c['vs_best']:+.1f}% | "
                     + ("-" if c["vs_dense"] is None else f"{100 * c['vs_dense']:+.1f}%") + " |")
        L.append("")
    return L


def build_outputs(o, results, cp, command):
    """CSV, PNG and report.md from the collected (row, record) pairs."""
    os.makedirs(o.out, exist_ok=True)
    cp_rate = {(r["ranks"], r["bandwidth"], r["cycle_ms"]): r["bytes_per_s_per_rank"] for r in cp
               if r["status"] == "ok"}
    steps, cycle, tta, curves, acc = [], [], [], [], []
    for row, record in results:
        if row["part"] in ("steps", "cycle"):
            (steps if row["part"] == "steps" else cycle).append(steps_row(row, record, o, cp_rate) if record else row)
        elif row["part"] == "tta":
            if record:
                row, points = tta_row(row, record, o)
                curves += points
            tta.append(row)
        else:
            if record:
                row.update(record_fields(record))
            acc.append(row)
    add_relative(steps)
    runs = None
    if any(r.get("repeat") for r in steps):      # --repeats: the cells are the medians of the runs
        runs, steps = steps, median_rows(steps)
    add_relative(cycle)
    add_vs_dense_accuracy(acc)
    written = []
    for name, rows, cols in (("steps.csv", steps, STEPS_COLUMNS), ("steps_runs.csv", runs, STEPS_COLUMNS),
                             ("cycle.csv", cycle, STEPS_COLUMNS),
                             ("control_plane.csv", cp, CP_COLUMNS),
                             ("tta.csv", tta, TTA_COLUMNS), ("accuracy.csv", acc, ACC_COLUMNS)):
        if rows:
            write_csv(os.path.join(o.out, name), rows, cols)
            written.append(name)
    if curves:
        write_csv(os.path.join(o.out, "tta_curves.csv"), curves,
                  ["run_id", "label", "bandwidth", "step", "epoch", "wall_s", "test_loss", "test_acc"])
        written.append("tta_curves.csv")
    pngs = plot_all(o.out, steps, tta, curves)
    write_report(os.path.join(o.out, "report.md"), o, steps, cycle, cp, tta, acc, pngs, command, runs)
    return written + pngs + ["report.md"]

