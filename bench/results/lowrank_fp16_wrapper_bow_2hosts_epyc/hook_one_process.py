"""torch's powerSGD_hook r4, plain and inside fp16_compress_wrapper, on the embedding model in ONE process
(Gloo, world size 1: no link, no other rank), one thread, Adam, batch 16: each step's time (60 steps,
3 alternations) and, from cProfile over 30 steps, the hook's batched products (``torch.bmm``) and the
backward pass's own C++ time (where the hook's element-wise work and the wrapper's casts run). Prints
the CPU's float16 flags first: without avx512_fp16 the CPU has no native float16 arithmetic.
Run from the repository root:
    python bench/results/lowrank_fp16_wrapper_bow_2hosts_epyc/hook_one_process.py"""
import cProfile
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

sys.path.insert(0, os.getcwd())
from bench.arms import START_POWERSGD_ITER  # noqa: E402  (the benchmark's DDP arms' dense first steps)
from bench.tasks import BagOfWords  # noqa: E402

NAMES = {False: "plain (float32)", True: "wrapped (float16)"}
BACKWARD = "<method 'run_backward' of 'torch._C._EngineBase' objects>"     # cProfile's name: its own time


def make_step(fp16):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(BagOfWords(), bucket_cap_mb=1000)   # one bucket
    state = psgd.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=START_POWERSGD_ITER)
    model.register_comm_hook(state, default_hooks.fp16_compress_wrapper(psgd.powerSGD_hook) if fp16
                             else psgd.powerSGD_hook)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tokens, labels = torch.randint(0, 65536, (16, 32)), torch.randint(0, 10, (16,))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(tokens), labels).backward()
        opt.step()
    for _ in range(START_POWERSGD_ITER + 3):      # past the dense steps
        step()
    return step


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    flags = open("/proc/cpuinfo").read().split("flags", 2)[1].split("\n")[0].split()
    print("CPU float16/bfloat16 flags:", " ".join(f for f in flags if "fp16" in f or "bf16" in f or f == "f16c"))
    for _ in range(3):
        for fp16 in (False, True):
            step = make_step(fp16)
            start = time.perf_counter()
            for _ in range(60):
                step()
            seconds = (time.perf_counter() - start) / 60
            print(f"{NAMES[fp16]:18} step {seconds * 1e3:6.1f} ms")
    for fp16 in (False, True):
        step, profile = make_step(fp16), cProfile.Profile()
        profile.runcall(lambda: [step() for _ in range(30)])
        stats = pstats.Stats(profile).stats
        bmm = next(v for k, v in stats.items() if k[2] == "<built-in method torch.bmm>")
        backward = next(v for k, v in stats.items() if k[2] == BACKWARD)
        print(f"{NAMES[fp16]:18} torch.bmm {bmm[2] / bmm[1] * 1e3:5.2f} ms a call, "
              f"{bmm[2] / 30 * 1e3:5.1f} ms a step; backward's own C++ {backward[2] / 30 * 1e3:5.1f} ms a step")


if __name__ == "__main__":
    main()
