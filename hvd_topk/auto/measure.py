"""What the tuner measures of this machine, and its one contact with the other ranks.

``time_compression`` times this rank's top-k selection, one pass over an accumulator, a thin matrix
product and dense_fp16's own work around its exchange (σ, π, μ and φ of ``hvd_topk.auto.plans``);
``sample_quality`` measures what Top-K and low rank would send of one accumulator
(``hvd_topk.auto.quality``), in the norm of an Adam-type optimizer's update where it has one
(``adam_weights``); ``HorovodWorld`` has the ranks agree on numbers. A test may hand the tuner another
world with the same three methods.
"""
import statistics

import torch
from horovod.torch import mpi_ops

from ..core.lowrank import (compressed_rank, finish_power_iteration, kept_energy, m_times_q, matrix_shape, mt_times_p,
                            start_power_iteration, warm_start)
from ..core.sparsify import k_for, sq_norm64, topk_energies, topk_indices
from ..transports.collectives import add_rows, agree
from ..transports.dense import decode_sum, encode_fp16

__all__ = ["HorovodWorld", "time_compression", "sample_quality", "lowrank_sizes", "adam_weights", "ADAM_TYPES"]

# The optimizers whose update scales each gradient entry by 1 / sqrt(v_hat) (``adam_weights``)
ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam)

# The compression timing: a tensor as large as the largest compressed one (this size when none is),
# capped so that it stays a fraction of a second on a slow host; the median of a few repeats, so that
# one slow call on a busy host does not count.
_TIMING_NUMEL_NO_TENSOR = 1 << 16
_TIMING_MAX_NUMEL = 1 << 22              # 4M elements: per-element costs are flat well before that
_TIMING_REPEATS = 3
_TIMING_SEED = 0                         # the same tensor on every rank and every probe
_TIMING_RANK = 4                         # the matrix product's thin side (torch's hook's usual rank)


class HorovodWorld:
    """The tuner's only contact with the other ranks; a test may give a tuner another object with the
    same three methods (``tuner.world = ...``)."""

    @staticmethod
    def agree(values, name):
        """``values`` averaged over the ranks, bit-identical everywhere (collective)."""
        return agree(values, name)

    @staticmethod
    def size():
        return mpi_ops.size()

    @staticmethod
    def rank():
        return mpi_ops.rank()


def time_compression(numels, ratio, clock):
    """This rank's [s per element of a top-k selection, s per element of one pass, s per multiply-add of
    a thin matrix product (M Q and M^T P at rank 4), s per element of dense_fp16's work around its
    exchange (its encoding and residual, the adds of 2 ranks' values, the scale)], from a tensor as large
    as the largest of ``numels`` (dict name -> elements), capped at ``_TIMING_MAX_NUMEL``."""
    n = min(max(numels.values(), default=_TIMING_NUMEL_NO_TENSOR), _TIMING_MAX_NUMEL)
    x = torch.randn(n, generator=torch.Generator().manual_seed(_TIMING_SEED))
    k = k_for(n, ratio)
    rows = max(1, int(n ** 0.5))
    matrix, q = x[:rows * (n // rows)].view(rows, -1), torch.ones(n // rows, _TIMING_RANK)
    sel, sweep, products, fp16 = [], [], [], []
    for _ in range(_TIMING_REPEATS):
        t0 = clock()
        topk_indices(x, k)
        t1 = clock()
        x.add_(x, alpha=0.0)
        t2 = clock()
        mt_times_p(matrix, m_times_q(matrix, q))     # the transport's own products
        t3 = clock()
        # the transport's own functions; the cat stands for the allgather's output (the copy Horovod makes)
        buf, _ = encode_fp16(x, 2)
        decode_sum(add_rows(torch.cat([buf, buf]).view(2, n)), 0.5, x.dtype)
        fp16.append(clock() - t3)
        products.append(t3 - t2)
        sweep.append(t2 - t1)
        sel.append(t1 - t0)
    return [statistics.median(sel) / n, statistics.median(sweep) / n,
            statistics.median(products) / (2 * matrix.numel() * _TIMING_RANK), statistics.median(fp16) / n]


def lowrank_sizes(lowrank, names):
    """name -> (n, m, r) of the tensors of ``names`` that ``lowrank`` (a ``LowRank``) has a shape for:
    its matrix view and rank, r = 0 where it would send the tensor dense."""
    out = {}
    for name in names:
        shape = lowrank.shapes.get(name)
        if shape is not None and matrix_shape(shape) is not None:
            out[name] = matrix_shape(shape) + (compressed_rank(shape, lowrank.rank, lowrank.min_compression_rate),)
    return out


def sample_quality(acc, key, k, lowrank, weight=None):
    """(||acc||^2, what Top-K at k sends of it, what low rank sends of it) for this rank's flat
    accumulator of ``key`` (``hvd_topk.auto.quality``); low rank's from its warm start for the key (or
    the seeded first one), all of it where the key goes dense there.

    ``weight`` (flat, or None): the norm is ||weight * x|| instead, an Adam-type optimizer's (``adam_weights``):
    what a compressor leaves out of its update, not of the gradient. Each compressor still chooses as its
    transport does (Top-K by |acc|, low rank's power iteration on acc); what it sends is the energy less
    its error, ||w acc||^2 - ||w (acc - C(acc))||^2, which for low rank may be below 0 (its P Q^T adds
    error where Adam's weights are large)."""
    if weight is None:
        energy = sq_norm64(acc)
        topk = topk_energies(acc, [min(k, acc.numel())])[0]
    else:
        weighted = weight * acc
        energy = sq_norm64(weighted)
        topk = sq_norm64(weighted[topk_indices(acc, min(k, acc.numel()))])
    sizes = lowrank_sizes(lowrank, [key]).get(key)
    if not sizes or not sizes[2]:
        return energy, topk, energy
    n, m, r = sizes
    q = warm_start(lowrank.q.get(key), key, m, r, lowrank.seed, acc)
    if weight is None:
        return energy, topk, kept_energy(acc.view(n, m), q, lowrank.epsilon)
    _, p = start_power_iteration(acc.view(n, m), q, lowrank.epsilon)
    p, q_new = finish_power_iteration(acc.view(n, m), p, lowrank.epsilon)
    error = sq_norm64(weight.view(n, m) * (acc.view(n, m) - p @ q_new.T))
    return energy, topk, energy - error


def adam_weights(optimizer, params, key, grad):
    """1 / (sqrt(v_hat) + eps), flat: the factor by which an Adam-type ``optimizer`` (``ADAM_TYPES``)
    scales each entry of parameter ``key``'s (``params``: name -> parameter) flat gradient ``grad`` in
    the update that ``grad`` makes: v = beta2 v + (1 - beta2) grad^2 from its state's ``exp_avg_sq``
    (0 before its first step), v_hat = v / (1 - beta2^(step + 1)), its group's ``betas`` and ``eps``.
    None for other optimizers (their update is the gradient's own norm) and unknown keys."""
    p = params.get(key)
    if not isinstance(optimizer, ADAM_TYPES) or p is None:
        return None
    state = optimizer.state.get(p, {})
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    beta2, step, v = group["betas"][1], float(state.get("step", 0)), state.get("exp_avg_sq")
    v = (1 - beta2) * grad.square() + (0.0 if v is None else beta2 * v.reshape(-1))
    return 1.0 / ((v / (1.0 - beta2 ** (step + 1))).sqrt() + group["eps"])
