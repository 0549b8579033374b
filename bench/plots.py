"""The grid's plots: link bytes per step, speed-up over dense, and time-to-accuracy curves (PNG)."""
import os

from bench.constants import BANDWIDTHS, MODES
from bench.grid import EXAMPLES
from bench.rows import mode_name

_STYLE = {0.1: ":", 0.01: "-", 0.001: "--"}     # line style by ratio; colour by mode


def _color(label):
    return f"C{list(MODES).index(label) % 10}"


def plot_all(out, steps, tta, curves):
    """bytes_per_step.png, speedup.png and tta_<example>.png (only those with data); returns the names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in steps if r["status"] == "ok" and "link_bytes" in r]
    return _plot_bytes(plt, out, ok) + _plot_speedup(plt, out, ok) + _plot_tta(plt, out, tta, curves)


def _plot_bytes(plt, out, ok):
    """bytes_per_step.png: measured link bytes per mode and link, with the theoretical bytes marked."""
    written = []
    ranks_list = sorted({r["ranks"] for r in ok})
    if ok:
        width_in = max(5.5, 0.5 * len({mode_name(r) for r in ok}))
        fig, axes = plt.subplots(1, len(ranks_list), figsize=(width_in * len(ranks_list), 4.5), squeeze=False)
        for ax, ranks in zip(axes[0], ranks_list):
            rs = [r for r in ok if r["ranks"] == ranks]
            names = list(dict.fromkeys(mode_name(r) for r in rs))
            bws = [b for b in BANDWIDTHS if any(r["bandwidth"] == b for r in rs)]
            width = 0.8 / max(1, len(bws))
            for j, bw in enumerate(bws):
                xs, ys = [], []
                for i, name in enumerate(names):
                    hit = [r for r in rs if mode_name(r) == name and r["bandwidth"] == bw]
                    if hit:
                        xs.append(i + (j - (len(bws) - 1) / 2) * width)
                        ys.append(hit[0]["link_bytes"])
                ax.bar(xs, ys, width, label=f"measured, {bw}")
            theo = [(i, next((r["theoretical_bytes"] for r in rs if mode_name(r) == name
                              and r.get("theoretical_bytes")), None)) for i, name in enumerate(names)]
            theo = [(i, t) for i, t in theo if t]
            if theo:
                ax.scatter(*zip(*theo), marker="_", s=400, color="black", zorder=3, label="theoretical")
            ax.set_yscale("log")
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
            ax.set_ylabel("link bytes per rank per step")
            ax.set_title(f"{ranks} ranks")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "bytes_per_step.png"), dpi=100)
        plt.close(fig)
        written.append("bytes_per_step.png")

    return written


def _plot_speedup(plt, out, ok):
    """speedup.png: step-time speed-up over dense per mode, against the link."""
    written = []
    fast = [r for r in ok if "speedup_vs_dense" in r]
    if fast:
        ranks_list = sorted({r["ranks"] for r in fast})
        fig, axes = plt.subplots(1, len(ranks_list), figsize=(5.5 * len(ranks_list), 4.2), squeeze=False)
        for ax, ranks in zip(axes[0], ranks_list):
            rs = [r for r in fast if r["ranks"] == ranks]
            bws = [b for b in BANDWIDTHS if any(r["bandwidth"] == b for r in rs)]
            for name in dict.fromkeys(mode_name(r) for r in rs):
                mine = [r for r in rs if mode_name(r) == name]
                pts = sorted((bws.index(r["bandwidth"]), r["speedup_vs_dense"]) for r in mine)
                ax.plot(*zip(*pts), marker="o", label=name, color=_color(mine[0]["label"]),
                        linestyle=_STYLE.get(mine[0].get("ratio"), "-"))
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xticks(range(len(bws)))
            ax.set_xticklabels(bws)
            ax.set_xlabel("link")
            ax.set_yscale("log")
            ax.set_ylabel("step-time speed-up over dense")
            ax.set_title(f"{ranks} ranks")
            ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "speedup.png"), dpi=100)
        plt.close(fig)
        written.append("speedup.png")

    return written


def _plot_tta(plt, out, tta, curves):
    """tta_<example>.png: test accuracy (or loss) against training wall clock, one panel per link."""
    written = []
    for example in dict.fromkeys(r["example"] for r in tta if r["status"] == "ok"):
        metric = EXAMPLES[example].metric
        rs = [r for r in tta if r["status"] == "ok" and r["example"] == example]
        bws = [b for b in BANDWIDTHS if any(r["bandwidth"] == b for r in rs)]
        fig, axes = plt.subplots(1, len(bws), figsize=(4.5 * len(bws), 3.6), squeeze=False, sharey=True)
        for ax, bw in zip(axes[0], bws):
            for r in rs:
                if r["bandwidth"] != bw:
                    continue
                pts = [(c["wall_s"], c[metric]) for c in curves if c["run_id"] == r["run_id"]]
                if pts:
                    ax.plot(*zip(*pts), marker=".", label=mode_name(r), color=_color(r["label"]))
            ax.set_title(f"{example}, {rs[0]['ranks']} ranks, {bw}")
            ax.set_xlabel("training wall clock (s)")
            ax.set_ylabel("test accuracy" if metric == "test_acc" else "test loss (nats/byte)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"tta_{example}.png"), dpi=100)
        plt.close(fig)
        written.append(f"tta_{example}.png")
    return written
