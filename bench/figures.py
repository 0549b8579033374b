"""The figures of a run, from its records (one record per seed): pure functions, no jobs, no files.

Per arm: the median step (and its 10th/90th percentiles) over the measured steps of every seed, the
median bytes per rank per step over the turns, against the bytes the arm's scheme must send
(``theoretical_bytes``, one host only: across hosts the counters see the inter-host traffic alone),
its speed-up and bytes against the dense reference, the final test figure (mean over seeds), and
per target the training seconds and steps at which each seed first reached it (``time_to``).

Targets: the fixed values asked for, and, for every dense reference in the run (``bench.arms.DENSE``),
its final accuracy less one point or, for a loss, its final loss plus 2% (per seed: each seed's own
dense run). An accuracy is reached at or above its target, a loss at or below.
"""
import statistics

from hvd_topk.auto.costmodel import HIST_BYTES
from hvd_topk.auto.plans import TRANSPORTS
from hvd_topk.core.sparsify import k_for

from bench.arms import DENSE, FIXED_TRANSPORTS, parse_arm

__all__ = ["SCHEMES", "theoretical_bytes", "scheme_of", "time_to", "targets_of", "summarize"]

SCHEMES = ("dense", "fp16", "topkef", "artopk", "allgather", "split_reduce")
AUTO_TARGET = 0.05          # auto's median step within 5% of the fastest fixed transport (unlimited: dense)


def theoretical_bytes(scheme, tensors, min_numel, ratio, ranks, value_bytes=4):
    """Bytes per rank per step that ``scheme`` must put on the link (payload only: no headers, no
    control plane), from the gradients' shapes.

    Verified against Horovod 0.28.1 and its bundled Gloo (third_party/gloo):

    - Allreduce: ``GlooAlgorithms::Allreduce`` calls ``gloo::allreduce`` without choosing an algorithm,
      which runs ``ring`` (gloo/allreduce.cc): reduce-scatter then allgather over ``numSegments``
      segments (a multiple of N, at least 2N); each rank sends ``numSegments - numSegmentsPerRank``
      segments per phase, i.e. (N-1)/N of the buffer, and segments past the end are not sent. So B
      bytes cost 2(N-1)/N * B per rank (2(N-1) * B on the link in all). Horovod fuses the tensors of
      one cycle back to back into one buffer (``AllreduceOp::MemcpyInFusionBuffer``, no padding on
      CPU): fusion changes the number of messages, not the payload.
    - Broadcast (AR-Topk's index set): ``gloo::broadcast`` (gloo/broadcast.cc) is a binomial tree from
      the root, not root-to-all: every other rank receives the buffer exactly once, some from a rank
      that forwards it. The link carries (N-1) * B in all whoever sends, so (N-1)/N * B per rank on
      average.
    - Allgather: ``GlooAllgather`` calls ``gloo::allgatherv`` (gloo/allgatherv.cc), a ring of N-1
      rounds in which each rank forwards one rank's block; with equal blocks of B bytes a rank sends
      (N-1) * B. The block sizes come from the controller's response (``AllgatherOp::AllocateOutput``
      reads ``response.tensor_sizes()``), so no size exchange rides on the data plane.
    - Alltoall (split_reduce's first phase): every rank sends each other rank its block once, point
      to point; a rank's block for itself stays in memory.

    Per tensor of ``numel`` elements (fp32 gradients), k = max(1, ceil(ratio * numel)):

    ============ ======================================================  ==============================
    scheme       bytes per rank per step                                 sent dense (ring, 4 B/value)
    ============ ======================================================  ==============================
    dense        2(N-1)/N * 4 * numel                                    every tensor
    fp16         2(N-1)/N * 2 * numel (Horovod's fp16 compressor)        every tensor
    topkef       2(N-1)/N * 4(k+1) + (N-1)/N * 4k  (k values + 1 flag    numel < min_numel (TopKEF
                 allreduced; the leader's int32 index set broadcast;     looks at numel only: 1-D
                 no broadcast when k = numel)                            tensors are compressed)
    artopk       as topkef (hvd_topk.DistributedOptimizer, AR-Topk)      numel < min_numel or ndim <= 1
    allgather    (N-1) * (4(k+1) + 4(k+1)): two allgathers, the k        numel < min_numel or ndim <= 1
                 values + flag and the k int32 indices + flag slot
    split_reduce 8 * ((N-1)/N * k + (N-1)): alltoall of k rows (value    numel < min_numel or ndim <= 1
                 + int32 index) to their region's owner and 1 flag
                 row to every rank, the rank's own share off the link;
                 + 2(N-1)/N * 520: allreduce of a 130-int32 histogram;
                 + 8 * (N-1)/N * (k + N): allgatherv of the owners'
                 kept rows (at most k in all) + 1 padding row each
    ============ ======================================================  ==============================

    split_reduce's owners keep at most k rows in all (at least k - N + 1 when there are k candidates),
    so its allgather term is a bound, reached when they keep k; the alltoall's is exact.

    With ``value_bytes`` = 2 (``value_dtype=torch.float16``) the compressed tensors' values and flag
    take 2 bytes instead of 4 (split_reduce's rows: 6 bytes instead of 8); indices stay int32 and
    tensors sent dense keep their own dtype.

    Args:
        scheme: one of ``SCHEMES``.
        tensors: the run's ``tensors`` list of ``[name, numel, ndim]``.
        min_numel: tensors with fewer elements go dense.
        ratio: fraction kept (ignored by dense and fp16).
        ranks: N.
        value_bytes: bytes per value of a compressed tensor on the wire (4, or 2 for float16).

    Returns:
        float bytes per rank per step (0 at N = 1).

    Example:
        >>> theoretical_bytes("dense", [["w", 1000, 2]], 1024, 0.01, 2)     # 2(N-1)/N * 4000
        4000.0
        >>> theoretical_bytes("allgather", [["w", 10000, 2]], 1024, 0.01, 4) # 3 * 8 * 101
        2424.0
        >>> theoretical_bytes("split_reduce", [["w", 10000, 2]], 1024, 0.01, 4)  # 8 * 78 + 1.5 * 520 + 8 * 78
        2028.0
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    n = int(ranks)
    if n < 2:
        return 0.0
    ring = 2.0 * (n - 1) / n
    total = 0.0
    for _, numel, ndim in tensors:
        numel, ndim = int(numel), int(ndim)
        dense = (scheme in ("dense", "fp16") or numel < min_numel
                 or (scheme in ("artopk", "allgather", "split_reduce") and ndim <= 1))
        if dense:
            total += ring * numel * (2 if scheme == "fp16" else 4)
            continue
        k = k_for(numel, ratio)
        if scheme == "allgather":
            total += (n - 1) * (value_bytes + 4) * (k + 1)
        elif scheme == "split_reduce":
            row, share = value_bytes + 4, (n - 1) / n
            total += row * (share * k + (n - 1)) + ring * HIST_BYTES + row * share * (k + n)
        else:
            total += ring * value_bytes * (k + 1) + ((n - 1) / n * 4 * k if k < numel else 0.0)
    return total


def scheme_of(name, arm):
    """The ``theoretical_bytes`` scheme of arm ``name`` (its record ``arm``), or None (hierarchical,
    PowerSGD, or auto with a mix of transports)."""
    entry, overrides = parse_arm(name)
    if entry in ("horovod dense", "ddp"):
        return "dense"
    if entry in ("horovod fp16", "ddp fp16"):
        return "fp16"
    words = entry.split()
    comm = overrides.get("communication", words[1] if len(words) > 1 else "split_reduce")
    if words[0] == "topkef":            # stock Horovod: artopk shares its index sets its own way
        return "topkef" if comm == "artopk" else comm if comm in SCHEMES else None
    if words[0] != "hvd_topk":
        return None
    if comm == "auto":
        last = {k: v[-1] for k, v in arm["stats"].items() if v}
        used = [t for t in TRANSPORTS if last.get(f"auto_{t}")]
        comm = used[0] if len(used) == 1 else None
    return comm if comm in TRANSPORTS else None


def quantiles(values):
    """(median, 10th percentile, 90th percentile) of ``values``; Nones when there are none."""
    if not values:
        return None, None, None
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else list(values) * 9
    return statistics.median(values), q[0], q[-1]


def time_to(curve, target, lower_is_better=False):
    """(training seconds, steps) at the first evaluation that reached ``target``; None when none did.
    ``curve``: [steps, training s, accuracy, loss] in the order evaluated.

    Example:
        >>> time_to([[10, 4.0, 0.5, 1.0], [20, 8.5, 0.91, 0.3]], 0.9)
        (8.5, 20)
    """
    for steps, train_s, accuracy, loss in curve:
        value = loss if lower_is_better else accuracy
        if value is not None and (value <= target + 1e-12 if lower_is_better else value >= target - 1e-12):
            return train_s, steps
    return None


def targets_of(record, fixed, metric):
    """[(name, value)] of one seed's record: the fixed targets, then each dense reference's."""
    out = [(f"{metric} {t:g}", t) for t in fixed]
    for ref in DENSE:
        curve = record["arms"].get(ref, {}).get("curve")
        if curve:
            final = curve[-1][3] if metric == "loss" else curve[-1][2]
            name, value = ((f"{ref} + 2%", final * 1.02) if metric == "loss" else (f"{ref} - 1 pt", final - 0.01))
            out.append((name, value))
    return out


def _arm_figures(name, per_seed, record, reference):
    """One arm's figures over its seeds (``per_seed``: its record in each seed's record)."""
    step_ms = [1e3 * s for arm in per_seed for s in arm["measured_s"]]
    median, p10, p90 = quantiles(step_ms)
    nbytes = quantiles([b for arm in per_seed for b in arm["bytes"]])[0]
    finals = [arm["curve"][-1] for arm in per_seed if arm["curve"]]
    out = {"steps": per_seed[0]["steps"], "step_ms": median, "step_ms_p10": p10, "step_ms_p90": p90,
           "bytes": nbytes, "num_params": per_seed[0]["num_params"], "kind": per_seed[0]["kind"],
           "params_identical": all(arm["params_identical"] for arm in per_seed),
           "final_accuracy": _mean([f[2] for f in finals]), "final_loss": _mean([f[3] for f in finals]),
           "final_per_seed": [f[2] if f[2] is not None else f[3] for f in finals],
           "train_s": _mean([sum(arm["step_s"]) for arm in per_seed]),
           "powersgd_compression_rate": per_seed[0].get("powersgd_compression_rate"),
           "stats": {k: quantiles([v for arm in per_seed for v in arm["stats"].get(k, [])[record["warmup"]:]
                                   if v is not None])[0] for k in per_seed[0]["stats"]}}
    scheme = scheme_of(name, per_seed[-1])
    if scheme and record["iface"] == "lo" and nbytes:
        ratio = out["stats"].get("density") or record["ratio"]
        value_bytes = 2 if "fp16" in name.split()[-1] or "float16" in name else 4
        min_numel = 1024 if record["min_numel"] is None else record["min_numel"]
        theo = theoretical_bytes(scheme, per_seed[0]["tensors"], min_numel, ratio, record["ranks"], value_bytes)
        out.update(scheme=scheme, theoretical_bytes=theo, measured_over_theoretical=nbytes / theo if theo else None)
    if reference and median and reference["step_ms"] and nbytes and reference["bytes"]:
        out.update(speedup=reference["step_ms"] / median, bytes_vs_reference=nbytes / reference["bytes"])
    return out


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize(records, fixed_targets=()):
    """Every figure of a run (``records``: one per seed, same arms), as summary.json holds them."""
    first = records[0]
    metric = "loss" if all(a["curve"] and a["curve"][-1][2] is None for a in first["arms"].values()) else "accuracy"
    names = list(first["arms"])
    ref_name = next((r for r in DENSE if r in names), None)
    arms = {}
    for name in [ref_name] * bool(ref_name) + [n for n in names if n != ref_name]:
        arms[name] = _arm_figures(name, [r["arms"][name] for r in records], first, arms.get(ref_name))
    per_seed_targets = [targets_of(r, fixed_targets, metric) for r in records]
    target_names = [n for n, _ in per_seed_targets[0]]
    for name in names:
        reached = {}
        for t, tname in enumerate(target_names):
            hits = [time_to(r["arms"][name]["curve"], seed_targets[t][1], metric == "loss")
                    for r, seed_targets in zip(records, per_seed_targets)]
            done = [h for h in hits if h]
            reached[tname] = {"per_seed": hits, "reached": f"{len(done)}/{len(hits)}",
                              "train_s": statistics.median(h[0] for h in done) if len(done) == len(hits) else None,
                              "steps": statistics.median(h[1] for h in done) if len(done) == len(hits) else None}
        arms[name]["targets"] = reached
    fastest = {}
    for tname in target_names:
        done = [(arms[n]["targets"][tname]["train_s"], n) for n in names if arms[n]["targets"][tname]["train_s"]]
        fastest[tname] = min(done)[1] if done else None
    return {"setup": setup_of(records, metric), "reference": ref_name, "arms": {n: arms[n] for n in names},
            "targets": [{"name": n, "per_seed": [t[i][1] for t in per_seed_targets]} for i, n in enumerate(target_names)],
            "fastest": fastest, "auto": auto_vs_fixed(arms, first["link"])}


def auto_vs_fixed(arms, link):
    """``hvd_topk auto``'s median step against the fastest fixed transport of the run and dense; the
    target: within 5% of the fastest (on the unlimited link: of dense). None without both."""
    fixed = {n: a for n, a in arms.items() if n in FIXED_TRANSPORTS and a["step_ms"]}
    auto = arms.get("hvd_topk auto")
    if not auto or not auto["step_ms"] or not fixed:
        return None
    best = min(fixed, key=lambda n: fixed[n]["step_ms"])
    out = {"fastest_fixed": best, "vs_fastest": auto["step_ms"] / fixed[best]["step_ms"] - 1,
           "vs_dense": auto["step_ms"] / arms["horovod dense"]["step_ms"] - 1 if "horovod dense" in fixed else None}
    judged = out["vs_dense"] if link == "unlimited" else out["vs_fastest"]
    out["met"] = None if judged is None else judged <= AUTO_TARGET
    return out


def setup_of(records, metric):
    """What the run was, from its first record, and what every seed adds (seeds, job seconds)."""
    r = records[0]
    keys = ("task", "ranks", "hosts", "link", "iface", "cycle_ms", "launcher", "steps", "warmup", "turn",
            "eval_every", "batch_size", "ratio", "min_numel", "non_iid", "recipe", "steps_per_epoch", "rounds",
            "torch", "horovod", "env")
    return {**{k: r.get(k) for k in keys}, "metric": metric, "seeds": [rec["seed"] for rec in records],
            "job_s": [rec.get("job_s") for rec in records]}
