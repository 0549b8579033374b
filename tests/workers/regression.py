"""A 2-rank job that trains one fixed seed for 30 steps in every configuration of the core and writes a
digest of the final parameters of each: the regression reference of tests/test_regression.py.

Every configuration trains its own fresh model (same seed) with its own optimizer, one after the other
in the same job, through the public API only, so the digests compare any two versions of the core.
Only deterministic configurations are here: ``communication='auto'`` and the adaptive ratio decide
from measured times, which differ from run to run. The configurations recorded before 16-bit values
run with ``values='fp32'`` (the fused buckets must give their sums bit for bit); ``NEW_DEFAULTS`` run
the defaults since then (16-bit values; split_reduce as one allgather at 2 ranks). A configuration that
names no selection runs layer-wise, the default when all of them were recorded.
"""
import argparse
import hashlib
import json
import os

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_topk

STEPS = 30

# name -> (kind, options): "opt" configurations go to hvd_topk.DistributedOptimizer, "stock" ones to
# hvd.DistributedOptimizer with TopKEF.
CONFIGS = {
    "artopk_star_layerwise": ("opt", dict(communication="artopk", leader="star")),
    "artopk_var_layerwise": ("opt", dict(communication="artopk", leader="var")),
    "artopk_star_global": ("opt", dict(communication="artopk", selection="global")),
    "artopk_var_global": ("opt", dict(communication="artopk", leader="var", selection="global")),
    "allgather_layerwise": ("opt", dict(communication="allgather")),
    "allgather_global": ("opt", dict(communication="allgather", selection="global")),
    "dense": ("opt", dict(communication="dense")),
    "artopk_no_momentum_correction": ("opt", dict(momentum_correction=False)),
    "artopk_schedule_clip_nesterov": ("opt", dict(warmup_steps=5, dense_steps=2, clip_grad_norm=0.5,
                                                  nesterov=True, weight_decay=1e-3)),
    "allgather_float16_values": ("opt", dict(communication="allgather", values="fp16")),
    "artopk_groups": ("opt", dict(groups=1)),
    "artopk_sum_two_passes": ("opt", dict(op="sum", backward_passes_per_step=2)),
    "artopk_ratio_one": ("opt", dict(ratio=1.0)),
    "update_artopk_adam": ("opt", dict(compress="update", optimizer="adam")),
    "update_allgather_adam": ("opt", dict(compress="update", communication="allgather", optimizer="adam")),
    "update_artopk_sgd_no_local_momentum": ("opt", dict(compress="update", local_momentum=False)),
    "update_global_adam": ("opt", dict(compress="update", selection="global", optimizer="adam")),
    "stock_topkef": ("stock", dict()),
    "stock_topkef_sync_indices": ("stock", dict(sync_indices=True)),
}
# the defaults of 16-bit values and fused buckets (recorded with them; tests/data/regression_digests.json)
NEW_DEFAULTS = {
    "split_reduce_bf16": ("opt", dict(communication="split_reduce", values="bf16")),
    "allgather_bf16_global": ("opt", dict(communication="allgather", selection="global", values="bf16")),
    "split_reduce_bf16_no_buckets": ("opt", dict(communication="split_reduce", values="bf16", bucket_cap_mb=1e-6)),
    "stock_topkef_split_reduce_bf16": ("stock", dict(communication="split_reduce", values="bf16")),
    "stock_topkef_allgather_fp16": ("stock", dict(communication="allgather", values="fp16")),
}
CONFIGS.update(NEW_DEFAULTS)


def train(kind, options):
    """Train the MLP for STEPS steps; returns its parameters (identical on every rank)."""
    options = dict(options)
    torch.manual_seed(1234 + hvd.rank())            # different init per rank: broadcast must fix it
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    if options.pop("optimizer", "sgd") == "adam":
        base = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        if kind == "opt" and options.get("compress", "gradient") == "gradient":
            options.setdefault("momentum_correction", True)   # the default when the reference was recorded
        base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=options.pop("nesterov", False),
                               weight_decay=options.pop("weight_decay", 0.0))
    op = hvd.Sum if options.pop("op", "average") == "sum" else hvd.Average
    passes = options.pop("backward_passes_per_step", 1)
    ratio = options.pop("ratio", 0.05)
    options.setdefault("communication", "artopk")   # the default when the reference was recorded
    selection = options.pop("selection", "layerwise")    # likewise (the default is global now)
    wire = dict(values=options.pop("values", "fp32"), bucket_cap_mb=options.pop("bucket_cap_mb", 25.0))
    if kind == "stock":
        compression = hvd_topk.TopKEF(ratio=ratio, min_numel=64, sync_indices=options.pop("sync_indices", False),
                                      communication=options.pop("communication"), selection=selection, **wire)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression,
                                       op=op, backward_passes_per_step=passes)
    else:
        opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                            compression=hvd_topk.TopKEF(ratio=ratio, min_numel=64, **wire), op=op,
                                            backward_passes_per_step=passes, communication=options.pop("communication"),
                                            groups=options.pop("groups", None),
                                            settings=hvd_topk.OptimizerSettings(selection=selection, **options))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    for step in range(STEPS):
        opt.zero_grad()
        gen = torch.Generator().manual_seed(100_000 * hvd.rank() + step)
        for _ in range(passes):
            x = torch.randn(16, 32, generator=gen)
            ((model(x) - x @ w_true) ** 2).mean().backward()
        opt.step()
    return {n: q.detach().clone() for n, q in model.named_parameters()}


def digest(params):
    """sha256 of every parameter's bytes, in name order: equal digests mean bit-identical parameters."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--record", help="also write rank 0's digests to this JSON file (the reference)")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    result = {}
    for name, (kind, options) in CONFIGS.items():
        params = train(kind, options)
        result[name] = {"digest": digest(params),
                        "abs_sum": float(sum(q.double().abs().sum() for q in params.values()))}
    torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
    if args.record and hvd.rank() == 0:
        with open(args.record, "w") as f:
            json.dump({"steps": STEPS, "torch": torch.__version__, "configs": result}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
