"""Link bytes: what a scheme must put on the link (``theoretical_bytes``) and what one run measured.

The measured side is the loopback's kernel counters, read by the example's rank 0 at every step
boundary (``loopback_tx_bytes`` in examples/common.py, the counter ``testbed.wire.loopback_bytes``
reads); here they are cut to the measured steps (after the warm-up and auto's trial) and set against
the payload the scheme must send.
"""
import statistics

from hvd_topk.auto.costmodel import HIST_BYTES
from hvd_topk.auto.plans import TRANSPORTS
from hvd_topk.core.sparsify import k_for

SCHEMES = ("dense", "fp16", "topkef", "artopk", "allgather", "split_reduce")


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


def scheme_of(record):
    """The theoretical-bytes scheme of a run's JSON record, or None when it cannot be known.

    ``communication='auto'`` reports in ``hvd_topk_stats`` how many tensors (of those it may compress)
    use each transport at the end (``auto_dense``, ``auto_artopk``, ``auto_allgather``,
    ``auto_split_reduce``): when they all use one, that is the scheme; a mix (the per-tensor plan is
    not in the record) gives None."""
    compression = record.get("compression")
    comm = record.get("communication")
    if compression == "topkef":           # stock Horovod: artopk shares its index sets its own way
        return "topkef" if comm in ("artopk", None) else comm
    if compression in ("none", "fp16"):
        return {"none": "dense", "fp16": "fp16"}[compression]
    if comm == "auto":
        stats = record.get("hvd_topk_stats") or {}
        used = [t for t in TRANSPORTS if stats.get(f"auto_{t}")]
        comm = used[0] if len(used) == 1 else None
    return comm if comm in TRANSPORTS else None


def settled_step(record):
    """The first step after auto's last trial of plans and the switch that follows it (0: no trial)."""
    history = (record.get("hvd_topk_auto") or {}).get("history") or []
    ends = [h[0] for h in history if str(h[3]).startswith("trial,")]
    return ends[-1] + 2 if ends else 0


def measure(record, warmup, min_measured):
    """Step time and link bytes of one run after ``warmup`` steps, and after auto's trial of plans;
    ValueError if too few remain.

    Returns:
        dict: measured_steps, step_s (median), step_s_p10, step_s_p90,
        link_bytes (sum of link_tx_bytes over the measured steps / steps / ranks).
    """
    warmup = max(warmup, settled_step(record))
    times, tx = record["step_times_s"][warmup:], record["link_tx_bytes"][warmup:]
    if len(times) < min_measured:
        raise ValueError(f"{len(record['step_times_s'])} steps, {warmup} warm-up: fewer than "
                         f"{min_measured} measured steps")
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return {"measured_steps": len(times), "step_s": statistics.median(times), "step_s_p10": q[0],
            "step_s_p90": q[-1], "link_bytes": sum(tx) / len(tx) / record["ranks"]}

