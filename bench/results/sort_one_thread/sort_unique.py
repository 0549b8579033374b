"""The transports' sorts of indices on the CPU: torch's sort and unique against numpy's (numpy's sort
is what ``hvd_topk.core.sparsify.ascending`` uses; numpy's unique was tried and dropped), at one torch
thread and at two,
over random int64 indices of the sizes the benchmarks' models select (1% of 0.15M, 2.18M, 6.3M and
25M parameters; the unique's input: 4 ranks' candidates of one owner). Median of 200 calls after 5
warm-up calls; prints a table and writes manifest.json beside this file. Run from the repository root:
    python bench/results/sort_one_thread/sort_unique.py"""
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
from bench.manifest import write_manifest  # noqa: E402


def median_ms(f, calls=200):
    for _ in range(5):
        f()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[calls // 2]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    print("threads | m | torch sort ms | numpy sort ms | torch unique ms | numpy unique ms")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m, span in ((1_500, 150_000), (21_800, 2_180_000), (63_000, 6_300_000), (250_000, 25_000_000)):
            gen = torch.Generator().manual_seed(m)
            idx = torch.randperm(span, generator=gen)[:m]
            many = torch.randint(0, span, (4 * m,), generator=gen)       # 4 ranks' candidates, overlapping
            row = [median_ms(lambda: idx.sort().values),
                   median_ms(lambda: torch.from_numpy(np.sort(idx.numpy()))),
                   median_ms(lambda: torch.unique(many, return_inverse=True)),
                   median_ms(lambda: np.unique(many.numpy(), return_inverse=True))]
            print(f"{threads} | {m:,} | " + " | ".join(f"{x:.3f}" for x in row), flush=True)
    write_manifest(here, command="python bench/results/sort_one_thread/sort_unique.py")


if __name__ == "__main__":
    main()
