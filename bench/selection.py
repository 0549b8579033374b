"""Fast exact Top-K selection (hvd_topk.core.sparsify.topk_indices) against torch.topk and one x.abs() pass.

For every size, dtype and ratio it times the three side by side in one run (interleaved repeats,
median), checks that the index set equals torch.topk's, and measures the peak extra memory of each.
Prints a table and writes select_<device>.csv and select_<device>.png to --out.

    python -m bench select                                   # 1M/10M/25M/100M fp32 on CPU
    python -m bench select --sizes 25M --ratios 0.01         # the headline row
    python -m bench select --dtypes fp32,fp16,bf16 --device cuda

Memory, CPU (Linux, glibc): the peak resident set size (VmHWM, reset through /proc/self/clear_refs
before each call) minus the resident size before the call. Before each measured call glibc hands its
free pages back to the kernel (malloc_trim) and its mmap threshold is pinned to 128 KiB, so whatever
the call allocates and touches, torch's temporaries included, must fault in fresh pages and shows in
the resident set (to within the kernel's RSS counter batching, about 0.25 MiB). This phase runs after
all timings, which therefore see glibc's default allocator behaviour. Memory, CUDA: torch's allocator
statistics (max_memory_allocated minus memory_allocated before the call).
"""
import csv
import ctypes
import os
import platform
import re
import statistics
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")               # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

from bench.manifest import write_manifest  # noqa: E402
from hvd_topk.core import sparsify  # noqa: E402
from hvd_topk.core.sparsify import k_for, topk_indices  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COLUMNS = ["device", "dtype", "n", "ratio", "k", "ours_ms", "pass_ms", "topk_ms", "abs_ms", "topk_over_ours",
           "topk_over_pass", "ours_over_abs", "input_mib", "ours_peak_mib", "pass_peak_mib", "topk_peak_mib",
           "abs_peak_mib", "agree"]
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter number


def parse_size(text):
    """'25M' -> 25_000_000; accepts K, M, G suffixes and plain integers."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", text.strip().upper())
    if not match:
        raise ValueError(f"size must look like 1000, 10K, 25M or 1G, got {text!r}")
    return int(float(match.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[match.group(2)])


def make_input(n, dtype, device, seed):
    """Standard normal input, generated on the CPU so that every device sees the same values."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen, dtype=dtype).to(device)


def methods(x, k):
    """The timed calls, by name. "ours" is the public selection, which picks torch.topk or the sampled
    pass by size, dtype and device; "pass" is the sampled pass alone, to show where the two cross."""
    return {"ours": lambda: topk_indices(x, k),
            "pass": lambda: sparsify._topk_by_threshold(x.detach(), k),
            "topk": lambda: torch.topk(x.abs(), k, sorted=False).indices,
            "abs": lambda: x.abs()}


def time_methods(x, k, repeats):
    """Median seconds per method; repeats interleave the methods so that drift hits all alike."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    calls = methods(x, k)
    for call in calls.values():  # warm-up: first-touch allocations, kernel caches
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def agreement(x, k, ours):
    """'yes' if ours is torch.topk's index set, 'tie' if only a tied k-th magnitude differs, else 'NO'."""
    ref = torch.topk(x.abs(), k, sorted=False).indices
    if torch.equal(ours.sort().values, ref.sort().values):
        return "yes"
    mags = x.abs().float()
    same = torch.equal(mags[ours].sort().values, mags[ref].sort().values)
    return "tie" if same else "NO"


class PeakMemory:
    """Peak extra memory of one call: resident set on CPU, torch allocator statistics on CUDA."""

    def __init__(self, device):
        self.device = device
        if device == "cpu":
            self.libc = ctypes.CDLL("libc.so.6")
            self.libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)

    def measure(self, call):
        """MiB above the level before the call, at the call's peak."""
        if self.device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            call()
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - before) / 2**20
        self.libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
        before = self._status("VmRSS")
        call()
        return (self._status("VmHWM") - before) / 2**20

    @staticmethod
    def _status(field):
        """A /proc/self/status field, in bytes."""
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def plot(rows, path):
    """Speed-up over torch.topk and cost relative to one abs pass, against n, per dtype and ratio."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for ratio in dict.fromkeys(r["ratio"] for r in rows):
            sel = [r for r in rows if r["dtype"] == dtype and r["ratio"] == ratio]
            label = f"{dtype}, ratio {ratio:g}"
            left.plot([r["n"] for r in sel], [r["topk_over_ours"] for r in sel], "o-", label=label)
            right.plot([r["n"] for r in sel], [r["ours_over_abs"] for r in sel], "o-", label=label)
    left.axhline(10, color="grey", ls="--", lw=1, label="target 10x")
    right.axhline(1.5, color="grey", ls="--", lw=1, label="target 1.5x")
    left.set(xscale="log", yscale="log", xlabel="elements", ylabel="torch.topk time / ours",
             title="speed-up over torch.topk")
    right.set(xscale="log", xlabel="elements", ylabel="ours time / one x.abs() pass",
              title="cost in abs passes")
    right.set_ylim(bottom=0)
    left.yaxis.set_major_formatter(ScalarFormatter())
    left.yaxis.set_minor_formatter(NullFormatter())
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"exact Top-K selection, {rows[0]['device']}, torch {torch.__version__}, "
                 f"{torch.get_num_threads()} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(rows):
    """Rows as an aligned text table."""
    head = ["dtype", "n", "ratio", "k", "ours ms", "pass ms", "topk ms", "abs ms", "topk/ours", "topk/pass",
            "ours/abs", "in MiB", "ours MiB", "pass MiB", "topk MiB", "abs MiB", "same set"]
    cells = [[r["dtype"], f"{r['n']:,}", f"{r['ratio']:g}", f"{r['k']:,}", f"{r['ours_ms']:.2f}",
              f"{r['pass_ms']:.2f}", f"{r['topk_ms']:.2f}", f"{r['abs_ms']:.2f}", f"{r['topk_over_ours']:.2f}x",
              f"{r['topk_over_pass']:.2f}x", f"{r['ours_over_abs']:.2f}x", f"{r['input_mib']:.0f}",
              f"{r['ours_peak_mib']:.1f}", f"{r['pass_peak_mib']:.1f}", f"{r['topk_peak_mib']:.0f}",
              f"{r['abs_peak_mib']:.0f}", r["agree"]] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def main(args):
    """Time, check and measure every size x dtype x ratio of ``args`` (the CLI's ``select``); returns
    the exit status. ValueError naming a bad value before anything runs."""
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"--dtypes must be a subset of {','.join(DTYPES)}, got {','.join(bad)}")
    if any(not 0 < r <= 1 for r in args.ratios) or args.repeats < 1:
        raise ValueError(f"--ratios must each lie in (0, 1] and --repeats be >= 1, got {args.ratios}, {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench select: --device cuda given but CUDA is not available; nothing to do.")
        return 0
    os.makedirs(args.out, exist_ok=True)
    device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                   else platform.processor() or platform.machine())
    print(f"torch {torch.__version__}, device {args.device} ({device_name}), "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}, "
          f"median of {args.repeats} interleaved repeats")
    inputs = [(n, dname) for n in args.sizes for dname in args.dtypes]
    rows = []
    # Phase 1: timings and agreement, with the allocator left as it is in real use.
    for n, dname in inputs:
        x = make_input(n, DTYPES[dname], args.device, args.seed)
        for ratio in args.ratios:
            k = k_for(n, ratio)
            t = time_methods(x, k, args.repeats)
            rows.append({"device": args.device, "dtype": dname, "n": n, "ratio": ratio, "k": k,
                         "ours_ms": t["ours"] * 1e3, "pass_ms": t["pass"] * 1e3, "topk_ms": t["topk"] * 1e3,
                         "abs_ms": t["abs"] * 1e3, "topk_over_ours": t["topk"] / t["ours"],
                         "topk_over_pass": t["topk"] / t["pass"], "ours_over_abs": t["ours"] / t["abs"],
                         "input_mib": x.numel() * x.element_size() / 2**20,
                         "agree": agreement(x, k, topk_indices(x, k))})
            print(f"  timed {dname} n={n:,} ratio={ratio:g}", file=sys.stderr, flush=True)
        del x
    # Phase 2: peak memory of one call each (see the module docstring for the method).
    peak = PeakMemory(args.device)
    for n, dname in inputs:
        x = make_input(n, DTYPES[dname], args.device, args.seed)
        for row in [r for r in rows if (r["n"], r["dtype"]) == (n, dname)]:
            for name, call in methods(x, row["k"]).items():
                row[f"{name}_peak_mib"] = peak.measure(call)
        del x
    print_table(rows)
    print(f"load average at the end {os.getloadavg()[0]:.2f} (timings are only comparable on an idle machine)")
    csv_path = os.path.join(args.out, f"select_{args.device}.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    png_path = os.path.join(args.out, f"select_{args.device}.png")
    plot(rows, png_path)
    write_manifest(args.out)
    print(f"wrote {csv_path} and {png_path}")
    return 0
