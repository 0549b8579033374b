"""What ``TopKEF`` (and ``PowerSGD``) hands Horovod's allreduce when its own transport carries the values.

With ``communication='split_reduce'`` or ``'allgather'`` the values travel in collectives that TopKEF
starts itself, named per key. Horovod still allreduces whatever ``compress`` returns, so TopKEF returns
this token: 4 elements per tensor, in the gradient's dtype (Horovod's grouped allreduce takes one dtype
per group). Its sum tells ``decompress`` two things a ``Compressor`` is never told:

1. How Horovod combines the ranks (its ``op``). Each rank sends ``[1, 1 on rank 0 else 0, f, f*f]``.
   Sum gives ``[P, 1, ...]``; Average, with or without ``gradient_predivide_factor``, gives
   ``[1, 1/P, ...]``. Anything else (Adasum combines vectors non-linearly) raises. Every rank holds the
   same reduced token, so every rank takes the same decision.
2. Whether every rank compressed this gradient under the same key. Horovod matches its allreduce by
   the parameter's name, and ``f`` is a fingerprint of the key TopKEF gave it (for a TopKEF without
   names, its position in the step). All ranks' ``f`` are equal exactly when ``P * sum(f*f) == sum(f)**2``
   (Cauchy-Schwarz), a test every rank evaluates on the same numbers. Fingerprints are small integers
   (1..16), so both sums are integers that float32 rounding (Average's division by P) cannot move by
   half a unit; half-precision gradients send f = 1 (no check): the transports' own size checks remain.
"""
import zlib

import torch
from horovod.torch import mpi_ops

__all__ = ["OpToken", "fingerprint", "TOKEN_SIZE"]

FINGERPRINTS = 16
TOKEN_SIZE = 4                # elements of a token


def fingerprint(key):
    """A small integer in 1..16 from a key, identical on every rank."""
    return zlib.crc32(repr(key).encode()) % FINGERPRINTS + 1


class OpToken:
    """Builds the token and reads Horovod's reduction and the key check back from its sum.

    Args:
        process_set: the ranks Horovod reduces over (the optimizer's process set).
        mismatch_hint: what the key-mismatch error tells the user to do.
        door: the compressor's class name, as the errors name it.
    """

    def __init__(self, process_set=mpi_ops.global_process_set, mismatch_hint="", door="TopKEF"):
        self.process_set, self.mismatch_hint, self.door = process_set, mismatch_hint, door

    def make(self, key, like):
        """The token for ``key``, in ``like``'s dtype and device."""
        f = 1.0 if like.dtype in (torch.float16, torch.bfloat16) else float(fingerprint(key))
        first = 1.0 if self.process_set.rank() == 0 else 0.0
        return torch.tensor([1.0, first, f, f * f], dtype=like.dtype, device=like.device)

    def failed(self, like):
        """A token whose fingerprint (0) no key has: every rank that reduces it with tokens of real keys
        fails the key check (a compress that failed hands it to Horovod, ``compressor_door``)."""
        first = 1.0 if self.process_set.rank() == 0 else 0.0
        return torch.tensor([1.0, first, 0.0, 0.0], dtype=like.dtype, device=like.device)

    def average(self, reduced, key):
        """True if Horovod averaged, False if it summed; raises ValueError on any other reduction, or
        when the ranks compressed this gradient under different keys."""
        size = self.process_set.size()
        ones, first, f, f2 = (float(v) for v in reduced.to(torch.float64).cpu())
        if abs(ones - size) <= 1e-3 * size and abs(first - 1.0) <= 1e-3:
            scale = 1.0                        # Sum
        elif abs(ones - 1.0) <= 1e-3 and abs(first * size - 1.0) <= 1e-3:
            scale = float(size)                # Average: undo the division for the key check
        else:
            raise ValueError(_neither_sum_nor_average(ones, first, size, self.door))
        total, total_sq = round(f * scale), round(f2 * scale)     # integers: sums of f and f*f
        if size * total_sq != total * total:
            hint = self.mismatch_hint or f"every rank must give {self.door} the same named_parameters"
            raise ValueError(f"{self.door}: the ranks compressed the gradient Horovod reduced here under different "
                             f"keys (this rank's: {key!r}); {hint}")
        return size > 1 and scale != 1.0


def _neither_sum_nor_average(ones, first, size, door):
    """The error for a token that neither Sum nor Average over the ``door``'s ``size`` ranks gives. Whole
    ``ones`` with a rank-0 flag of 0 or 1/m is a plain Sum or Average over m ranks, just not the door's:
    the optimizer reduces over a process set the door was not given. Anything else is another ``op``."""
    def whole(x):
        return round(x) >= 1 and abs(x - round(x)) <= 1e-3
    if whole(ones) and (abs(first) <= 1e-3 or whole(1.0 / first)):
        return (f"{door}: Horovod reduced this gradient over a set of ranks other than {door}'s process_set "
                f"({size} ranks; the token summed to {[ones, first]}): the optimizer has a process_set that "
                f"{door} was not given. Give {door} the same set: hvd.DistributedOptimizer(opt, process_set=ps, "
                f"compression={door}(..., process_set=ps)); the class form compression={door} runs over all "
                "ranks only")
    return (f"{door} supports op=hvd.Average or hvd.Sum (with any gradient_predivide_factor); "
            f"Horovod reduced its token to {[ones, first]} over {size} ranks, which neither "
            "gives (op=hvd.Adasum combines gradients non-linearly; it cannot carry top-k entries)")
