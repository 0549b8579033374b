"""Which collective wins where, from the alpha-beta cost model alone (hvd_topk.auto.costmodel; no jobs run).

Modelled communication time of one gradient message (default 100 MB: 25M fp32 parameters) for the
dense ring and tree allreduce, the Top-K allgather (values + int32 indices), AR-Topk over ring and
tree and split_reduce (Ok-Topk's split and reduce), against workers (8 .. 1024), link bandwidth
(100 Mbit/s .. 100 Gbit/s) and density.

    python -m bench scale                          # PNGs + CSV + summary into bench/results/scale/
    python -m bench scale --alpha 1e-3 --message-mb 4 --out bench/results/scale_4mb
    python -m bench scale --alpha 2.9e-3 --beta 3.2e-7 --out bench/results/scale_fitted   # 4 ranks, 100 Mbit/s tbf

By default α is 50 µs and the links are four nominal bandwidths (β = 8 / bits per second). ``--alpha``
and ``--beta`` take the model fitted to measurements instead: the α (s) and β (s/byte) that the probe
of a ``communication='auto'`` run fitted, ``opt.stats()['alpha']`` and ``['beta']`` (a benchmark's raw
summary.json keeps its medians under ``arms`` -> the arm -> ``stats``); each ``--beta`` replaces the four nominal
links by one link of that β, so the plots show which collective wins from 8 to 1024 workers on the
measured network (docs/costmodel.md).

Writes ``scale_winner.png`` (winner over workers x density, one panel per link),
``scale_time_vs_workers.png``, ``scale_time_vs_bandwidth_density.png``, ``scale.csv`` (every grid
point: the modelled time of every collective, the winner, and its speed-up over the better dense
allreduce) and ``scale_summary.md`` (the winners at a few grid points, and where split_reduce wins),
also printed.
"""
import csv
import os

import matplotlib
import numpy as np

matplotlib.use("Agg")               # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from bench.manifest import write_manifest  # noqa: E402
from hvd_topk.auto import costmodel  # noqa: E402

WORKERS = [2 ** i for i in range(3, 11)]                          # 8 .. 1024
BANDWIDTHS = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9, "10 Gbit/s": 10e9, "100 Gbit/s": 100e9}
DENSITIES = np.logspace(-4, 0, 33)                                 # 1e-4 .. 1, 8 per decade
COLORS = {"dense_ring": "#4c72b0", "dense_tree": "#8fb3e0", "artopk_ring": "#dd8452",
          "artopk_tree": "#f2c18f", "split_reduce": "#8172b3", "allgather": "#55a868"}
LABELS = {"dense_ring": "dense ring allreduce", "dense_tree": "dense tree allreduce",
          "artopk_ring": "AR-Topk (ring)", "artopk_tree": "AR-Topk (tree)",
          "split_reduce": "split_reduce (Ok-Topk)", "allgather": "Top-K allgather"}
SUMMARY_WORKERS = (8, 64, 1024)
SUMMARY_DENSITIES = (0.1, 0.01, 0.001)
# The nominal links of the line plots: time against workers on a slow-ish and a fast link, against
# density on a middle one.
LINE_LINKS = {"1 Gbit/s": 1e9, "100 Gbit/s": 100e9}
DENSITY_LINK = ("10 Gbit/s", 10e9)


def beta_of(bits_per_s):
    """Seconds per byte of a link of ``bits_per_s``."""
    return 8.0 / bits_per_s


def links(betas):
    """Panel label -> bits/s: one link per fitted β (s/byte) when ``betas`` is given, else BANDWIDTHS."""
    if not betas:
        return dict(BANDWIDTHS)
    return {f"fitted link, {rate_label(8.0 / b)}": 8.0 / b for b in betas}


def rate_label(bits_per_s):
    """"25 Mbit/s", "3.81 Gbit/s"."""
    return f"{bits_per_s / 1e9:.3g} Gbit/s" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:.3g} Mbit/s"


def point(n, density, bits_per_s, args):
    """(modelled seconds of every collective, the cheapest, its speed-up over the better dense one)."""
    spec = (n, args.message_mb * 1e6, float(density), args.alpha, beta_of(bits_per_s), args.index_bytes,
            args.value_bytes)
    times = costmodel.predict(*spec)
    winner = costmodel.choose(*spec)
    return times, winner, min(times["dense_ring"], times["dense_tree"]) / times[winner]


def write_csv(path, args):
    """Every grid point as one CSV row."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["workers", "bandwidth_bps", "density", "alpha_s", "message_bytes",
                    *[f"{name}_s" for name in costmodel.COLLECTIVES], "winner", "speedup_vs_dense"])
        for bw in args.links.values():
            for n in WORKERS:
                for c in DENSITIES:
                    times, name, speedup = point(n, c, bw, args)
                    w.writerow([n, f"{bw:.0f}", f"{c:.6g}", args.alpha, f"{args.message_mb * 1e6:.0f}",
                                *[f"{times[k]:.6g}" for k in costmodel.COLLECTIVES], name, f"{speedup:.4g}"])


def plot_winner(path, args, plt):
    """Heatmaps of the winning collective over (workers, density), one panel per bandwidth."""
    names = list(costmodel.COLLECTIVES)
    cmap = ListedColormap([COLORS[n] for n in names])
    x_edges = np.log2(WORKERS + [WORKERS[-1] * 2]) - 0.5               # one column per power of two
    log_c = np.log10(DENSITIES)
    step = log_c[1] - log_c[0]
    y_edges = 10 ** np.concatenate([log_c - step / 2, [log_c[-1] + step / 2]])
    cols = min(2, len(args.links))
    rows = -(-len(args.links) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(7.5, 6 * cols), 4.5 * rows + 1.5), sharex=True, sharey=True,
                             squeeze=False)
    for ax in axes.flat[len(args.links):]:
        ax.set_visible(False)
    for ax, (label, bw) in zip(axes.flat, args.links.items()):
        grid = np.array([[names.index(point(n, c, bw, args)[1]) for n in WORKERS]
                         for c in DENSITIES])
        ax.pcolormesh(x_edges, y_edges, grid, cmap=cmap, vmin=-0.5, vmax=len(names) - 0.5, shading="flat")
        xs = np.log2(WORKERS)
        ax.plot(xs, [costmodel.crossover_density(n, args.index_bytes, args.value_bytes) for n in WORKERS],
                "k--", lw=1.5, label="c* = 2/(N(1+s_i/s_v))")
        ax.set_yscale("log")
        ax.set_ylim(y_edges[0], 1.0)
        ax.set_title(f"{label}  (β = {beta_of(bw):.1e} s/B)")
        ax.set_xticks(xs, [str(n) for n in WORKERS])
        ax.grid(False)
    for ax in axes[-1]:
        ax.set_xlabel("workers N")
    for ax in axes[:, 0]:
        ax.set_ylabel("density c (fraction sent)")
    handles = [Patch(color=COLORS[n], label=LABELS[n]) for n in names]
    handles.append(axes[0, 0].get_lines()[0])
    fig.legend(handles=handles, loc="lower center", ncol=4 if cols > 1 else 2, fontsize=11 if cols > 1 else 9,
               frameon=False)
    fig.suptitle(f"Cheapest collective by the α-β model: message {args.message_mb:g} MB, α = {args.alpha:g} s, "
                 f"{args.index_bytes} B indices / {args.value_bytes} B values", fontsize=13 if cols > 1 else 9)
    fig.tight_layout(rect=(0, 0.1 if rows > 1 else 0.22, 1, 0.96 if rows > 1 else 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lines(ax, xs, series, xlabel, title, logx=True):
    """One log-log panel: modelled seconds of each collective against ``xs``."""
    for name in costmodel.COLLECTIVES:
        ax.plot(xs, series[name], color=COLORS[name], lw=2, marker="o", ms=3, label=LABELS[name],
                ls="--" if name.startswith("dense") else "-")
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("modelled communication time (s)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)


def plot_time_vs_workers(path, args, plt):
    """Time against workers at two links (the first two fitted ones, if given) x two densities."""
    line_links = list((LINE_LINKS if not args.beta else args.links).items())[:2]
    fig, axes = plt.subplots(len(line_links), 2, figsize=(12, 4.5 * len(line_links)), sharex=True, squeeze=False)
    for row, (label, bw) in enumerate(line_links):
        for col, c in enumerate((0.01, 0.001)):
            series = {name: [point(n, c, bw, args)[0][name] for n in WORKERS] for name in costmodel.COLLECTIVES}
            plot_lines(axes[row, col], WORKERS, series, "workers N", f"{label}, density {c:g}")
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].set_xticks(WORKERS, [str(n) for n in WORKERS])
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=11, frameon=False)
    fig.suptitle(f"Modelled time vs workers: message {args.message_mb:g} MB, α = {args.alpha:g} s", fontsize=13)
    fig.tight_layout(rect=(0, 0.07 if len(line_links) > 1 else 0.14, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_time_vs_bandwidth_density(path, args, plt):
    """Time against bandwidth (N = 64, c = 0.01; the sweep reaches the fitted links, marked) and against
    density (N = 64, 10 Gbit/s or the first fitted link)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    fitted = list(args.links.values()) if args.beta else []
    bws = np.logspace(np.log10(min([1e8] + fitted)), np.log10(max([1e11] + fitted)), 31)
    series = {name: [point(64, 0.01, bw, args)[0][name] for bw in bws] for name in costmodel.COLLECTIVES}
    plot_lines(left, bws / 1e9, series, "bandwidth (Gbit/s)", "N = 64, density 0.01")
    for bw in fitted:
        left.axvline(bw / 1e9, color="k", ls=":")
    label, bw = next(iter(args.links.items())) if args.beta else DENSITY_LINK
    series = {name: [point(64, c, bw, args)[0][name] for c in DENSITIES] for name in costmodel.COLLECTIVES}
    plot_lines(right, DENSITIES, series, "density c", f"N = 64, {label}")
    right.axvline(costmodel.crossover_density(64, args.index_bytes, args.value_bytes), color="k", ls=":",
                  label="c* allgather = dense ring (bandwidth)")
    right.legend(fontsize=9, loc="upper left")
    fig.suptitle(f"Modelled time vs bandwidth and density: message {args.message_mb:g} MB, α = {args.alpha:g} s",
                 fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(args):
    """Markdown: the winner (and its speed-up over the better dense allreduce) at a few grid points,
    then where split_reduce wins."""
    lines = [f"Modelled by the α-β cost model: message {args.message_mb:g} MB, α = {args.alpha:g} s, "
             f"{args.index_bytes} B indices / {args.value_bytes} B values. Cell: cheapest collective "
             f"(speed-up over the better dense allreduce). Communication only: Top-K selection time is not "
             f"modelled.", ""]
    head = "| link | density | " + " | ".join(f"N = {n}" for n in SUMMARY_WORKERS) + " |"
    lines += [head, "|" + "---|" * (2 + len(SUMMARY_WORKERS))]
    for label, bw in args.links.items():
        for c in SUMMARY_DENSITIES:
            cells = []
            for n in SUMMARY_WORKERS:
                _, name, speedup = point(n, c, bw, args)
                cells.append(f"{name} ({speedup:.1f}x)")
            lines.append(f"| {label} | {c:g} | " + " | ".join(cells) + " |")
    cross = ", ".join(f"N={n}: {costmodel.crossover_density(n, args.index_bytes, args.value_bytes):.3g}"
                      for n in SUMMARY_WORKERS)
    lines += ["", f"Allgather sends fewer bytes than a dense ring only below c* = 2/(N(1+s_i/s_v)): {cross}.", ""]
    return "\n".join(lines + split_reduce_wins(args))


def split_reduce_wins(args):
    """Markdown lines: the workers (of 8 .. 1024) at which split_reduce is the cheapest collective, per
    link and density decade, and the runner-up at the largest of them."""
    decades = [c for c in DENSITIES if c < 1 and np.isclose(np.log10(c), np.round(np.log10(c)))][::-1]
    lines = ["Workers at which split_reduce is the cheapest collective (of 8 .. 1024; in brackets: the "
             "runner-up at the largest of them, and its time over split_reduce's):", "",
             "| link | " + " | ".join(f"c = {c:g}" for c in decades) + " |", "|" + "---|" * (1 + len(decades))]
    for label, bw in args.links.items():
        cells = []
        for c in decades:
            wins = [n for n in WORKERS if point(n, c, bw, args)[1] == "split_reduce"]
            if not wins:
                cells.append("never")
                continue
            times = point(wins[-1], c, bw, args)[0]
            second = min((t, name) for name, t in times.items() if name != "split_reduce")[1]
            cells.append(f"{worker_ranges(wins)} ({second} x{times[second] / times['split_reduce']:.2f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def worker_ranges(workers):
    """"16-1024" for consecutive grid points of WORKERS, runs joined by ", "."""
    runs, start = [], 0
    for i in range(1, len(workers) + 1):
        if i == len(workers) or WORKERS.index(workers[i]) != WORKERS.index(workers[i - 1]) + 1:
            run = workers[start:i]
            runs.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
            start = i
    return ", ".join(runs)


def main(args):
    """The plots, CSV and summary of the CLI's ``scale`` (``args``: out, message_mb, alpha, beta,
    index_bytes, value_bytes); ValueError naming a bad value before anything is drawn."""
    # Bad values fail here, with costmodel's ValueError naming them, before any plotting.
    for beta in args.beta or [1e-9]:
        costmodel.predict(2, args.message_mb * 1e6, 0.5, args.alpha, beta, args.index_bytes, args.value_bytes)
    if args.beta and min(args.beta) <= 0:
        raise ValueError("--beta must be > 0: a link of no time per byte has no bandwidth to plot")
    args.links = links(args.beta)
    # The manifest first: outputs rewritten in place would mark the checkout dirty before it is written.
    manifest = write_manifest(args.out)
    outputs = [os.path.join(args.out, name) for name in
               ("scale_winner.png", "scale_time_vs_workers.png", "scale_time_vs_bandwidth_density.png", "scale.csv",
                "scale_summary.md")]
    plot_winner(outputs[0], args, plt)
    plot_time_vs_workers(outputs[1], args, plt)
    plot_time_vs_bandwidth_density(outputs[2], args, plt)
    write_csv(outputs[3], args)
    text = summary(args)
    with open(outputs[4], "w") as f:
        f.write(text + "\n")
    outputs.append(manifest)
    print(text)
    print("\nwrote " + ", ".join(os.path.relpath(o) for o in outputs))
    return 0
