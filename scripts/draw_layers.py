"""Draws docs/img/layers.png, the layers of hvd_topk/ (docs/design.md, "Architecture").

    python scripts/draw_layers.py

Each box is a file or package; a file imports only from its own layer and the layers below it, and
only the optimizer's factory imports auto/ (tests/test_layout.py checks the imports against ``LAYERS``).
"""
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

# (layer title, [(box label, what it holds, its files under hvd_topk/), ...]), top to bottom
LAYERS = [
    ("front doors", [
        ("compression.py  TopKEF", "Horovod's Compressor:\ncompressor_transports.py, op_token.py,\ngradient_keys.py",
         ["compression.py", "compressor_transports.py", "op_token.py", "gradient_keys.py"]),
        ("optimizer.py  DistributedOptimizer", "the factory; optimizer_methods.py\n(Horovod's overrides), arguments.py",
         ["optimizer.py", "optimizer_methods.py", "arguments.py"]),
    ]),
    ("the optimizer's step", [
        ("coordinator.py", "one synchronized step:\ndgc.py, schedule.py, bucket.py,\nupdate.py, stats.py",
         ["coordinator.py", "dgc.py", "schedule.py", "bucket.py", "update.py", "stats.py"]),
        ("auto/", "communication='auto', adaptive ratio:\ntuner, plans, trial, recheck,\ncostmodel, probe, measure",
         ["auto/"]),
        ("checkpoint.py, elastic.py", "per-rank files,\nelastic Horovod's handler", ["checkpoint.py", "elastic.py"]),
    ]),
    ("transports/  (one Transport protocol: base.py)", [
        ("dense.py", "allreduce of\neverything", ["transports/dense.py", "transports/base.py",
                                                  "transports/__init__.py"]),
        ("artopk.py", "one leader's index set:\nleaders.py, index_sets.py",
         ["transports/artopk.py", "transports/leaders.py", "transports/index_sets.py"]),
        ("allgather.py", "every rank's\nown top-k", ["transports/allgather.py"]),
        ("split_reduce.py", "owners sum regions,\nglobal top-k: regions.py",
         ["transports/split_reduce.py", "transports/regions.py"]),
        ("hierarchical.py", "dense in a host, split_reduce\nacross hosts: host_sets.py",
         ["transports/hierarchical.py", "transports/host_sets.py"]),
        ("collectives.py", "grouping, flags,\nagreement", ["transports/collectives.py"]),
    ]),
    ("core", [
        ("memory.py", "residuals: error\nfeedback per rank", ["memory.py"]),
        ("sparsify.py", "exact top-k,\nscatter, norms", ["sparsify.py"]),
        ("wire.py", "sizes on the wire", ["wire.py"]),
        ("validate.py", "argument checks'\nmessage shape", ["validate.py", "__init__.py"]),
    ]),
    ("Horovod 0.28.1, unpatched", [
        ("horovod.torch", "allreduce, allgather, alltoall, reducescatter, broadcast (Gloo or MPI)", []),
    ]),
]
COLOURS = ["#c6dbef", "#dadaeb", "#c7e9c0", "#fdd0a2", "#e0e0e0"]


def draw(path):
    fig, ax = plt.subplots(figsize=(12, 7.2))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, len(LAYERS) * 1.4)
    ax.axis("off")
    for i, (title, boxes) in enumerate(LAYERS):
        y = (len(LAYERS) - 1 - i) * 1.4 + 0.15
        ax.text(0.05, y + 1.12, title, fontsize=10, fontweight="bold", va="bottom")
        width = 11.9 / len(boxes)
        for j, (label, what, _) in enumerate(boxes):
            x = 0.05 + j * width
            ax.add_patch(FancyBboxPatch((x + 0.05, y), width - 0.15, 1.0, boxstyle="round,pad=0.02",
                                        facecolor=COLOURS[i], edgecolor="#555555"))
            ax.text(x + width / 2, y + 0.78, label, ha="center", va="center", fontsize=9, fontweight="bold")
            ax.text(x + width / 2, y + 0.35, what, ha="center", va="center", fontsize=7.5)
        if i:
            ax.annotate("", xy=(11.75, y + 1.02), xytext=(11.75, y + 1.36),
                        arrowprops=dict(arrowstyle="->", color="#555555"))
            ax.text(11.68, y + 1.19, "imports", ha="right", va="center", fontsize=7)
    ax.set_title("hvd_topk: a file imports from its own layer and the layers below", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    draw(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "img", "layers.png"))
