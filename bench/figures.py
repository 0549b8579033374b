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

from hvd_topk.auto.plans import TRANSPORTS
from hvd_topk.core.buckets import cap_numel, plan_buckets
from hvd_topk.core.codec import VALUE_KINDS, packed_nbytes
from hvd_topk.core.sparsify import k_for
from hvd_topk.core.validate import check_choice
from hvd_topk.core.wire import FLAG_BYTES, FRAME_BYTES, HIST_BYTES, budget_at
from hvd_topk.settings import TopKSettings
from hvd_topk.step.op_token import TOKEN_SIZE
from hvd_topk.transports.index_sets import PLAN_HEADER

from bench.arms import DENSE, FIXED_TRANSPORTS, TOPKEF_ARGS, parse_arm

__all__ = ["SCHEMES", "DOORS", "theoretical_bytes", "scheme_of", "topk_settings_of", "time_to", "targets_of",
           "summarize"]

SCHEMES = ("dense", "fp16", "topkef", "artopk", "allgather", "split_reduce")
DOORS = ("optimizer", "topkef")     # hvd_topk.DistributedOptimizer, or stock Horovod with TopKEF
AUTO_TARGET = 0.05          # auto's median step within 5% of the fastest fixed transport (unlimited: dense)


def theoretical_bytes(scheme, tensors, min_numel, ratio, ranks, value_kind="bf16", door="optimizer",
                      bucket_cap_mb=25.0, budget=None, sync_indices=False):
    """Bytes per rank per step (a float, 0 at N = 1) that ``scheme`` must put on the link (payload only: no
    TCP/IP headers, no Horovod control plane), from the gradients' shapes, once the buckets are planned.

    Verified against Horovod 0.28.1 and its bundled Gloo (third_party/gloo). Allreduce: ``gloo::allreduce``
    runs ``ring`` (gloo/allreduce.cc), reduce-scatter then allgather, each rank sending (N-1)/N of the
    buffer per phase (segments past the end are not sent): B bytes cost ring = 2(N-1)/N * B per rank;
    Horovod's fusion buffer (no padding on CPU) changes the number of messages, not the payload.
    Allgather: ``gloo::allgatherv``, a ring of N-1 rounds, each rank forwarding one rank's block: (N-1)/N
    of the blocks' sum per rank on average, (N-1) * B with equal blocks; the sizes come from the
    controller. Broadcast (``sync_indices``): a binomial tree, (N-1)/N * B per rank on average.
    Alltoall: each block sent once, point to point, a rank's own staying in memory.

    Compressed entries travel as ``hvd_topk.core.codec`` messages: msg(K, S) = ``packed_nbytes`` = 8
    (header) + [v K]4 (values: v = 2 for bf16 and fp16, 4 for fp32) + [c B]4 (a count per 65,536-index
    block but the last: B = ceil(S / 65,536) - 1, none when K = 0; c = 2 while K < 65,536, else 4) +
    [2 K]4 (16-bit offsets), each section rounded up to 4 bytes. allgather and split_reduce send buckets
    (``hvd_topk.core.buckets.plan_buckets``: the compressed tensors in the order of ``tensors``,
    reversed, cut at ``bucket_cap_mb`` MB of float32): bucket b has K_b entries over S_b indices (its
    tensors end to end), and each of its buffers is a frame of 8 + 4|b| bytes (int32 signature and
    count, a float32 flag per tensor) and one msg over [0, S_b).

    ============ ===========================================================================================
    scheme       bytes per rank per step, k = max(1, ceil(ratio * numel)) per compressed tensor
    ============ ===========================================================================================
    dense, fp16  ring * 4 (fp16: 2) * numel per tensor
    topkef       ring * 4(k+1) per tensor: its k values at the shared index set and a flag (float32); + once
                 a step (N-1)/N * 4(sum k + 3N): one allgather of the next step's int32 sets, each rank's
                 headed by 3 int32 (length, 2 fingerprints); ``sync_indices``: (N-1)/N * 4 sum k instead
    artopk       as topkef (hvd_topk.DistributedOptimizer's AR-Topk)
    allgather    (N-1) * (8 + 4|b| + msg(K_b, S_b)) per bucket: every rank's frame and message to every other
    split_reduce 1-2 ranks: as allgather (one allgather). From 3, per bucket, owner o getting K_o of the K_b
                 entries and keeping M_o of at most M_b = sum of max(k, int(budget_at(budget, N) k)), evenly:
                 (N-1)/N * sum_o (8 + 4|b| + msg(K_o, S_b)) (alltoall of a frame and message per owner) +
                 ring * 520|b| (130-int32 histogram rows) + (N-1)/N * sum_o msg(M_o, S_b) (allgatherv)
    ============ ===========================================================================================

    Sent dense (ring * 4 * numel): tensors below ``min_numel``, and with the optimizer 1-D ones (TopKEF
    compresses them); at k = numel, ring * 4 * numel (TopKEF: 4(numel+1), its flag). ``door='topkef'``
    (the 'topkef ...' arms) adds to allgather and split_reduce ring * 16 per compressed tensor: the
    float32 op token (``hvd_topk.step.op_token``) Horovod's allreduce gets instead. Exact, but for
    split_reduce from 3 ranks (the entries assumed spread evenly over the owners' regions, the kept ones
    a bound). ``value_kind`` is the fused transports' alone: AR-Topk's and the dense allreduces' values
    go in the gradients' dtype (float32).

    Args:
        scheme: one of ``SCHEMES``; tensors: the run's ``[name, numel, ndim]`` in registration order;
        min_numel: smaller tensors go dense; ratio: fraction kept; ranks: N; door: one of ``DOORS``
        ('topkef': stock Horovod with TopKEF, always so for scheme 'topkef'); value_kind, bucket_cap_mb,
        budget, sync_indices: the arm's TopKEF's ``values`` ('bf16', 'fp16', 'fp32') and the others.

    Example:
        >>> theoretical_bytes("dense", [["w", 1000, 2]], 1024, 0.01, 2)     # 2(N-1)/N * 4000
        4000.0
        >>> w = [["w", 10000, 2]]                                         # k = 100, one bucket
        >>> theoretical_bytes("allgather", w, 1024, 0.01, 4)              # 3 * (12 + 8 + 200 + 200)
        1260.0
        >>> theoretical_bytes("allgather", w, 1024, 0.01, 4, "fp32")      # 3 * (12 + 8 + 400 + 200)
        1860.0
        >>> theoretical_bytes("split_reduce", w, 1024, 0.01, 4)   # 0.75 * (4 * 124 + 4 * 112) + 1.5 * 520
        1488.0
        >>> theoretical_bytes("artopk", w, 1024, 0.01, 4)         # 1.5 * 4 * 101 + 0.75 * 4 * (100 + 12)
        942.0
    """
    scheme, value_kind = check_choice("scheme", scheme, SCHEMES), check_choice("value_kind", value_kind, VALUE_KINDS)
    stock = check_choice("door", door, DOORS) == "topkef" or scheme == "topkef"     # stock Horovod with TopKEF
    n = int(ranks)
    if n < 2:
        return 0.0
    ring, share = 2.0 * (n - 1) / n, (n - 1) / n
    total, sparse = 0.0, {}                       # sparse: position -> (numel, k) of the tensors compressed
    for i, (_, numel, ndim) in enumerate(tensors):
        numel, ndim = int(numel), int(ndim)
        if scheme in ("dense", "fp16") or numel < min_numel or (ndim <= 1 and not stock):
            total += ring * numel * (2 if scheme == "fp16" else 4)      # a plain allreduce in its own dtype
            continue
        k = k_for(numel, ratio)
        if k == numel:        # density 1: the optimizer's plain allreduce; TopKEF's carries its flag too
            total += ring * 4 * (numel + stock)
        else:
            sparse[i] = (numel, k)
    if not sparse:
        return total
    if scheme in ("topkef", "artopk"):
        sets = 4 * sum(k for _, k in sparse.values())        # 4 bytes per entry: an int32 index or a value
        # the values at the shared set and a flag per tensor (float32, allreduced); the sets: a broadcast
        # per tensor, or one allgather a step of each rank's header (PLAN_HEADER int32) and the sets it leads
        return total + ring * (sets + 4 * len(sparse)) + share * (sets if sync_indices else sets + 4 * PLAN_HEADER * n)
    if stock:                 # TopKEF hands Horovod's allreduce a float32 token per compressed tensor
        total += ring * 4 * TOKEN_SIZE * len(sparse)
    buckets = plan_buckets(list(sparse), {i: numel for i, (numel, _) in sparse.items()}, cap_numel(bucket_cap_mb))
    for bucket in buckets:
        span, entries = sum(sparse[i][0] for i in bucket), sum(sparse[i][1] for i in bucket)
        frame = FRAME_BYTES + FLAG_BYTES * len(bucket)      # signature, count, one flag per tensor
        if scheme == "allgather" or n <= 2:                 # one allgather of equal blocks
            total += (n - 1) * (frame + packed_nbytes(entries, span, value_kind))
            continue
        kept = sum(min(numel, max(k, int(budget_at(budget, n) * k))) for numel, k in (sparse[i] for i in bucket))
        # alltoall of a frame and message per owner (its own off the link), allreduce of the histogram
        # rows, allgatherv of each owner's kept sums (a message, no frame); owner o gets its even share
        total += share * sum(frame + packed_nbytes(entries // n + (o < entries % n), span, value_kind)
                             for o in range(n)) + ring * HIST_BYTES * len(bucket)
        total += share * sum(packed_nbytes(kept // n + (o < kept % n), span, value_kind) for o in range(n))
    return total


def scheme_of(name, arm):
    """The ``theoretical_bytes`` scheme of arm ``name`` (its record ``arm``), or None (hierarchical,
    PowerSGD, or auto with a mix of transports)."""
    entry, overrides = parse_arm(name)
    if entry in ("horovod dense", "ddp", "horovod fp16", "ddp fp16"):
        return "fp16" if entry.endswith("fp16") else "dense"
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
    return comm if comm in SCHEMES else None           # dense_fp16: the small tensors stay fp32


def topk_settings_of(name, record):
    """The ``TopKSettings`` arm ``name`` gives its TopKEF (``bench.arms.Build``): the run's ratio and
    min_numel, the values an entry named '... fp16' or '... fp32' presets, then the name's overrides.

    Example:
        >>> record = {"ratio": 0.01, "min_numel": None}
        >>> [topk_settings_of(n, record).values for n in ("hvd_topk allgather fp32", "topkef", "topkef[values=fp16]")]
        ['fp32', 'bf16', 'fp16']
    """
    entry, overrides = parse_arm(name)
    words = entry.split()
    preset = {"values": words[-1]} if words[0] in ("hvd_topk", "topkef") and words[-1] in VALUE_KINDS else {}
    run = {"ratio": record["ratio"], **({} if record["min_numel"] is None else {"min_numel": record["min_numel"]})}
    return TopKSettings(**{**run, **preset, **{k: v for k, v in overrides.items() if k in TOPKEF_ARGS}})


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
        topk = topk_settings_of(name, record)
        door = "topkef" if parse_arm(name)[0].split()[0] == "topkef" else "optimizer"
        theo = theoretical_bytes(scheme, per_seed[0]["tensors"], topk.min_numel,
                                 out["stats"].get("density") or topk.ratio, record["ranks"], topk.values, door,
                                 topk.bucket_cap_mb, topk.budget, topk.sync_indices)
        out.update(scheme=scheme, theoretical_bytes=theo, measured_over_theoretical=nbytes / theo if theo else None)
    if reference and median and reference["step_ms"] and nbytes and reference["bytes"] and out["kind"] != "local":
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
    fastest, trains = {}, [n for n in names if arms[n]["kind"] != "local"]     # compute only: trains nothing
    for tname in target_names:
        done = [(arms[n]["targets"][tname]["train_s"], n) for n in trains if arms[n]["targets"][tname]["train_s"]]
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
    """What the run was, from its first record, and what every seed adds (seeds, their seconds in the
    job; records made before the seeds shared a job hold each one's whole job's, ``job_s``)."""
    r = records[0]
    keys = ("task", "ranks", "hosts", "link", "iface", "cycle_ms", "launcher", "steps", "warmup", "turn",
            "eval_every", "batch_size", "ratio", "min_numel", "non_iid", "recipe", "steps_per_epoch", "rounds",
            "torch", "horovod", "env")
    return {**{k: r.get(k) for k in keys}, "metric": metric, "seeds": [rec["seed"] for rec in records],
            "seed_s": [rec.get("seed_s", rec.get("job_s")) for rec in records]}
