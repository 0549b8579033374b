"""Plot a ``bench.hierarchical`` results folder: per link, median step time (quartile whiskers) and
inter-host bytes per step of every mode, into ``<folder>/hierarchical.png``.

Reads ``summary.json``; a folder without one (a run cut short) is summarised from its
``<link>-modes.json`` / ``<link>-hha.json`` files, as ``bench.hierarchical`` does.

    python -m bench.plot_hierarchical bench/results/hierarchical_r0.01
"""
import argparse
import glob
import json
import os

from bench.constants import BANDWIDTHS

NAME = "hierarchical.png"


def load_rows(folder):
    """{link: {mode: {"median_ms", "q1_ms", "q3_ms", "bytes", ...}}} in the links' usual order."""
    path = os.path.join(folder, "summary.json")
    if os.path.exists(path):
        with open(path) as f:
            links = json.load(f)["links"]
    else:
        from bench.hierarchical import HHA, summarise
        links = {}
        for path in sorted(glob.glob(os.path.join(folder, "*-*.json"))):
            link, job = os.path.basename(path)[:-5].rsplit("-", 1)
            with open(path) as f:
                rows = summarise(json.load(f))
            if job == "hha":
                rows = {HHA: rows["dense"], "hvd_topk hierarchical (HHA job)": rows["hvd_topk hierarchical"]}
            links.setdefault(link, {}).update(rows)
    order = list(BANDWIDTHS)
    return dict(sorted(links.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def plot(folder, title=None):
    """Write ``folder/hierarchical.png``; returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = load_rows(folder)
    modes = list(dict.fromkeys(m for rows in links.values() for m in rows))
    colors = {m: f"C{i % 10}" for i, m in enumerate(modes)}
    fig, axes = plt.subplots(2, len(links), figsize=(4.2 * len(links) + 1.5, 7.5), squeeze=False, sharex="col")
    for col, (link, rows) in enumerate(links.items()):
        names = [m for m in modes if m in rows]
        xs = range(len(names))
        med = [rows[m]["median_ms"] for m in names]
        # whiskers: the quartiles, as distances below and above the median
        err = [[rows[m]["median_ms"] - rows[m]["q1_ms"] for m in names],
               [rows[m]["q3_ms"] - rows[m]["median_ms"] for m in names]]
        top, bottom = axes[0][col], axes[1][col]
        bars = top.bar(xs, med, yerr=err, capsize=3, color=[colors[m] for m in names])
        top.bar_label(bars, [f"{v:,.0f}" for v in med], fontsize=7, label_type="center", color="white")
        top.set_title(link)
        top.set_ylabel("step (ms), median and quartiles" if col == 0 else "")
        # bytes span 1 MB (sparse) to 76 MB (dense): log scale, so the sparse modes stay readable
        sent = [rows[m]["bytes"] for m in names]
        bars = bottom.bar(xs, sent, color=[colors[m] for m in names])
        bottom.bar_label(bars, [f"{b / 1e6:.2f} MB" for b in sent], fontsize=7)
        bottom.set_yscale("log")
        bottom.set_ylim(min(sent) / 4, max(sent) * 3)
        bottom.set_ylabel("inter-host bytes per step" if col == 0 else "")
        bottom.set_xticks(list(xs))
        bottom.set_xticklabels(names, rotation=55, ha="right", fontsize=7)
    fig.suptitle(title or os.path.basename(os.path.normpath(folder)))
    fig.tight_layout()
    path = os.path.join(folder, NAME)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a bench.hierarchical --out folder")
    p.add_argument("--title", help="figure title (default: the folder's name)")
    a = p.parse_args()
    print(plot(a.folder, a.title))
