"""One job of 4 ranks across 2 emulated hosts: Horovod's own DistributedOptimizer (fp16) on the char LM,
15 steps (the first 2 not counted) each with no extra process set, with the four host sets added, after
they were removed, and once more: the median and the longest step of each phase (rank 0)."""
import os
import statistics
import sys
import torch, horovod.torch as hvd
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from bench.tasks import Task
from bench.arms import build_arm
from bench.runner import train_step, Group
hvd.init(process_sets="dynamic")
torch.set_num_threads(1)
r, n = hvd.rank(), hvd.size()
task = Task("lm-small", r, n, seed=0, batch_size=None, steps=200, non_iid=False, optimizer=None, lr=None)
torch.manual_seed(0)
arm = build_arm("horovod fp16", 0, task, 0.01, None)
arm.last_step = -1
spec = {"eval_every": 10**9}
group = Group(False)
def phase(label, steps=15):
    ts = [train_step(arm, task, spec, group, r) for _ in range(steps)]
    ts = sorted(ts[2:])
    if r == 0:
        print(f"{label}: median {statistics.median(ts):.2f} s, max {max(ts):.1f}", flush=True)
phase("none")
sets = [hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3]), hvd.add_process_set([0, 2]), hvd.add_process_set([1, 3])]
phase("with 4 sets")
for s in sets:
    hvd.remove_process_set(s)
phase("removed")
phase("none again")
hvd.shutdown()
