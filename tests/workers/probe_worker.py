"""A multi-rank job for tests/test_probe.py: runs hvd_topk.auto.probe.Probe and saves what each rank got.

Every rank writes ``<out>/rank<r>.json`` with, per probe, its ProbeResult fields (floats
as ``float.hex`` too, so the test compares bits).
"""
import argparse
import json
import os

import horovod.torch as hvd
import torch

from hvd_topk.auto.probe import DEFAULT_SIZES, Probe

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--collectives", nargs="+", default=["allreduce"])
p.add_argument("--extension", action="store_true",
               help="also probe sizes (4, 8) with max_bytes 4 MiB: 8 B cannot take 4x 4 B, so sizes are added")
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
result = {"rank": hvd.rank(), "size": hvd.size(), "probes": {}}
probes = {c: Probe(sizes=args.sizes, repeats=args.repeats, collective=c) for c in args.collectives}
if args.extension:
    probes["extension"] = Probe(sizes=(4, 8), repeats=3, max_bytes=4 << 20, name="hvd_topk.probe.ext")
for key, probe in probes.items():
    res = probe.run()
    entry = res._asdict()
    entry["hex"] = {k: float(v).hex() for k, v in entry.items() if isinstance(v, float)}
    result["probes"][key] = entry
with open(os.path.join(args.out, f"rank{hvd.rank()}.json"), "w") as f:
    json.dump(result, f, indent=1)
