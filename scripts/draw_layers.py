"""Draws docs/img/layers.png, the layers of hvd_topk/ (docs/design.md, "Architecture").

    python scripts/draw_layers.py

Each box is a folder or file; a file imports only from its own layer and the layers below it, and
only the optimizer's factory imports auto/. The layers are ``LAYERS`` in tests/test_layout.py, which
checks the imports against them; this script reads them from there.
"""
import importlib.util
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402


def _layers():
    """The layer list lives with its check, in tests/test_layout.py; this script only draws it."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    spec = importlib.util.spec_from_file_location("test_layout", os.path.join(root, "tests", "test_layout.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.join(root, "tests"))       # test_layout imports conftest's ROOT
    spec.loader.exec_module(module)
    return module.LAYERS


LAYERS = _layers()
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
