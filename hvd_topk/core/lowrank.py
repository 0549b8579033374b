"""PowerSGD's math (Vogels, Karimireddy & Jaggi, NeurIPS'19), as torch's ``powerSGD_hook`` defines it:
pure functions over tensors, no Horovod. ``hvd_topk.transports.lowrank`` moves the P's and Q's.

One step of a tensor whose matrix view on rank i (of W) is M_i = (grad_i + residual_i) as n x m, at
rank r, with the warm-start Q (m x r) that every rank holds bit for bit::

    Q   <- orthogonalize(Q)                            start_power_iteration
    P_i  = M_i Q;          P = sum_i P_i               (allreduce)
    P   <- orthogonalize(P)                            finish_power_iteration
    Q_i  = M_i^T P;        Q = sum_i Q_i / W           (allreduce)
    aggregate = P Q^T (the average; W P Q^T the sum)   decompress
    residual_i = M_i - P Q^T                           each rank's own error feedback
    Q is kept for the next step's warm start           next_warm_start

Error feedback is exact over the ranks: sum_i residual_i + W P Q^T = sum_i M_i (the sum of what the
ranks accumulated leaves either as the aggregate or stays in some rank's residual).
"""
import math
import zlib

import torch

from .validate import check_int, check_number

__all__ = ["MIN_COMPRESSION_RATE", "matrix_shape", "compressed_rank", "orthogonalize", "warm_start_seed", "initial_q",
           "warm_start", "m_times_q", "mt_times_p", "start_power_iteration", "finish_power_iteration", "decompress",
           "next_warm_start", "kept_energy"]

# torch's min_compression_rate: a tensor is compressed only if it shrinks more than twofold, since
# the two matrix products and the second round trip cost more than they save below that.
MIN_COMPRESSION_RATE = 2


def matrix_shape(shape):
    """The (rows, columns) of a tensor's matrix view, as torch's hook takes it: the first dimension by
    all the others (a conv weight (out, in, kh, kw) is out x in*kh*kw); None below two dimensions.

    Example:
        >>> matrix_shape((8, 3, 3, 3))
        (8, 27)
        >>> matrix_shape((10,)) is None
        True
    """
    if len(shape) < 2:
        return None
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def compressed_rank(shape, rank, min_compression_rate=MIN_COMPRESSION_RATE):
    """The rank a tensor of ``shape`` is compressed at, or 0 when it goes dense.

    Args:
        shape: the tensor's shape (its matrix view: ``matrix_shape``).
        rank: the requested rank r (>= 1); at most min(n, m) is used.
        min_compression_rate: compress only if n*m > rate * r(n + m) (torch's rule; 2 by default).

    Returns:
        min(r, n, m), or 0 for a tensor below two dimensions or one that would not shrink enough.

    Example:
        >>> compressed_rank((64, 32), 4), compressed_rank((8, 8), 2), compressed_rank((9, 8), 2)
        (4, 0, 2)
    """
    check_int("rank", rank, low=1)
    check_number("min_compression_rate", min_compression_rate, low=0, low_open=True)
    nm = matrix_shape(shape)
    if nm is None:
        return 0
    n, m = nm
    r = min(rank, n, m)
    return r if r * (n + m) * min_compression_rate < n * m else 0


def orthogonalize(matrix, epsilon=0.0):
    """A copy of ``matrix`` (n x r, r <= n) with orthonormal columns, by Gram-Schmidt in column order
    (torch's ``_orthogonalize_gram_schmidt``), each column projected off the ones before it twice.

    Each column is divided by its norm + ``epsilon``. With epsilon 0 a column of norm 0 stays 0, which
    torch's hook means to do (it would divide 0 by 0): a layer whose gradient is zero sends zeros.

    Where a gradient's rank is below r, P = M Q has columns in the span of the ones before them: one
    projection leaves rounding noise that, normalised, can point along them again (a rank-1 gradient
    came out doubled: P Q^T sent that part of M twice). So each column is projected off the ones
    before it twice ("twice is enough", Giraud et al. 2005), and a column left with less than
    ``sqrt(eps)`` of its own norm (eps of its dtype) becomes 0: it held nothing but rounding, and a zero
    column sends nothing (``next_warm_start`` keeps that column's last Q).

    Where every column keeps more than that (the usual case; epsilon 0; float32 or float64), the same
    matrix comes from a QR decomposition (Householder: orthogonal to machine precision) with the signs
    of Gram-Schmidt, R's diagonal made positive: about 40 us instead of 250 for 1024 x 4 on one core,
    eight per step for a 4-layer model. Otherwise Gram-Schmidt itself decides, column by column.

    Example:
        >>> q = orthogonalize(torch.tensor([[3.0, 1.0], [4.0, 1.0]]))
        >>> torch.allclose(q.T @ q, torch.eye(2), atol=1e-6)
        True
    """
    if not epsilon and matrix.shape[1] > 1 and matrix.dtype in (torch.float32, torch.float64):
        q, r = torch.linalg.qr(matrix)
        diagonal = torch.diagonal(r)
        own = torch.linalg.vector_norm(matrix, dim=0) * torch.finfo(matrix.dtype).eps ** 0.5
        if bool((diagonal.abs() > own).all()):      # no column in the span of those before it
            return q * torch.sign(diagonal)
    return _gram_schmidt(matrix, epsilon)


def _gram_schmidt(matrix, epsilon):
    """``orthogonalize`` column by column (its docstring), each projected off the ones before twice."""
    out = matrix.clone()
    own = torch.linalg.vector_norm(matrix, dim=0) * torch.finfo(matrix.dtype).eps ** 0.5
    for i in range(out.shape[1]):
        col = out[:, i:i + 1]
        if i:                                       # the second projection off the columns before
            before = out[:, :i]
            col.sub_(before @ (before.T @ col))
        norm = torch.linalg.vector_norm(col)
        if i and norm <= own[i]:                    # in the span of the columns before: rounding only
            col.zero_()
            norm = torch.zeros_like(norm)
        if epsilon:
            col.div_(norm + epsilon)
        else:
            col.copy_(torch.where(norm > 0, col / norm, torch.zeros_like(col)))
        if i + 1 < out.shape[1]:
            rest = out[:, i + 1:]
            rest.sub_((col * rest).sum(dim=0, keepdim=True) * col)
    return out


def warm_start_seed(key, seed):
    """The seed of ``key``'s first Q: the same on every rank and in every process (a CRC of the key,
    not Python's salted ``hash``).

    Example:
        >>> warm_start_seed("fc.weight", 0) == warm_start_seed("fc.weight", 0) != warm_start_seed("fc.bias", 0)
        True
    """
    return (int(seed) << 32) ^ zlib.crc32(str(key).encode())


def initial_q(key, columns, rank, seed, dtype=torch.float32, device="cpu"):
    """``key``'s first Q (columns x rank), standard normal from ``warm_start_seed``, drawn on the CPU
    (as torch's hook does) and in float64 whatever ``dtype``, so that every rank, device and dtype
    starts from the same numbers; orthogonalized at the step's start like any warm start."""
    gen = torch.Generator().manual_seed(warm_start_seed(key, seed))
    return torch.randn(columns, rank, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def warm_start(stored, key, columns, rank, seed, like):
    """The Q a step of ``key`` starts from: the ``stored`` one (from the last step, or a checkpoint) when
    it has the shape columns x rank, else ``initial_q``; in ``like``'s dtype and on its device.

    Example:
        >>> warm_start(None, "w", 5, 2, seed=0, like=torch.zeros(1)).shape
        torch.Size([5, 2])
    """
    if stored is None or stored.shape != (columns, rank):
        return initial_q(key, columns, rank, seed, like.dtype, like.device)
    return stored.to(device=like.device, dtype=like.dtype)


def m_times_q(matrix, q):
    """M Q (n x r), written (Q^T M^T)^T: the same sums of products in another order, which torch's CPU
    matrix multiply runs 1.8-2.9x faster at r = 4 (4.6 against 2.1 ms at 65536 x 32, one thread;
    docs/studies/2026-11-low-rank.md). ``hvd_topk.auto`` times this very product."""
    return (q.T @ matrix.T).T


def mt_times_p(matrix, p):
    """M^T P (m x r), written (P^T M)^T, as ``m_times_q``: 5.6-14x faster (6.2 against 0.84 ms at
    65536 x 32, 56 against 10 ms at 2048 x 3072). torch's hook writes it as it reads."""
    return (p.T @ matrix).T


def start_power_iteration(matrix, q, epsilon=0.0):
    """(the warm start Q orthogonalized, this rank's P_i = M_i Q): the first half of the step.

    Example:
        >>> q, p = start_power_iteration(torch.eye(3)[:, :2] * 2, torch.eye(2))
        >>> p.shape
        torch.Size([3, 2])
    """
    q = orthogonalize(q, epsilon)
    return q, m_times_q(matrix, q)


def finish_power_iteration(matrix, p_sum, epsilon=0.0):
    """(P: the ranks' summed P orthogonalized, this rank's Q_i = M_i^T P): the second half."""
    p = orthogonalize(p_sum, epsilon)
    return p, mt_times_p(matrix, p)


def decompress(p, q_sum, ranks, average):
    """(aggregate, mean, q): what the ranks' summed Q's give.

    Args:
        p: the orthogonalized P (n x r), identical on every rank.
        q_sum: the sum over the ranks of Q_i (m x r).
        ranks: how many ranks summed (W).
        average: the aggregate is the mean (P Q^T), else the sum (P (W Q)^T).

    Returns:
        The aggregate (n x m); the mean P Q^T, which every rank's residual subtracts (M_i - mean);
        Q = q_sum / W, the next warm start (torch's hook keeps the averaged Q). Summing, the aggregate
        is W times the mean, so Σ_i residual_i + aggregate = Σ_i M_i holds for the numbers computed.

    Example:
        >>> agg, mean, q = decompress(torch.eye(2), torch.full((2, 2), 4.0), ranks=2, average=False)
        >>> agg.tolist(), mean.tolist()
        ([[4.0, 4.0], [4.0, 4.0]], [[2.0, 2.0], [2.0, 2.0]])
    """
    q = q_sum * (1.0 / ranks)
    mean = p @ q.T                                  # the one n x m product: the sum is W times it
    return (mean if average else mean * ranks), mean, q


def next_warm_start(q_old, q_new):
    """The Q the next step starts from: ``q_new``, but where one of its columns is all zero (a zero
    gradient, or one of rank below r), that column of ``q_old``: a zero column would make that column
    of every later P zero.

    Example:
        >>> next_warm_start(torch.ones(3, 2), torch.tensor([[2.0, 0], [2, 0], [2, 0]])).tolist()
        [[2.0, 1.0], [2.0, 1.0], [2.0, 1.0]]
    """
    return torch.where((q_new != 0).any(dim=0, keepdim=True), q_new, q_old)


def kept_energy(matrix, q, epsilon=0.0):
    """The squared norm of the rank-r approximation P Q^T that one step from the warm start ``q`` makes
    of ``matrix`` alone (one rank's view): what of its energy a low-rank step sends at once, the rest
    staying in the residual. ``hvd_topk.auto`` divides it by ||matrix||^2 to compare with Top-K's.

    P has orthonormal (or zero) columns, so ||P Q^T|| = ||Q|| with Q = M^T P: no n x m product is made.

    Example:
        >>> m = torch.outer(torch.arange(1.0, 4.0), torch.ones(5))    # rank 1: all of it is kept
        >>> round(kept_energy(m, torch.ones(5, 1)), 3), float(m.square().sum())
        (70.0, 70.0)
    """
    _, p = start_power_iteration(matrix, q, epsilon)
    _, q_new = finish_power_iteration(matrix, p, epsilon)
    return float(q_new.double().square().sum())
