"""Which transport each compressed tensor of the optimizer takes in a step, and with what k.

Every input is the same on every rank (the step, the schedule, auto's plan, the pins), so every rank
routes alike: the transports' collectives match, and ``hvd_topk.step.fused_plan`` can tell each fused
transport at a step's first start which keys it gets.
"""

__all__ = ["route", "DENSE"]

DENSE = ("dense", "dense_fp16")           # the transports that send every entry


def route(state, key, n):
    """(transport name, k, k_next, gains) of ``key`` (``n`` elements) this step, for the
    ``StepCoordinator`` ``state``: 'dense' at density 1, 'dense_fp16' where auto's plan or a pin chose it
    at a lower density, else the configured (or auto's, or pinned) transport where every rank selects its
    own top-k, else 'artopk'."""
    k, k_next = state.schedule.k(n, state.step), state.schedule.k(n, state.step + 1)
    mode = state.communication if state.tuner is None else state.tuner.mode(key, state.communication)
    mode = (state.pin or {}).get(key, mode)
    gains = state.tuner is not None and state.tuner.wants_gains(state.step)
    # fp16 only where the schedule compresses: its dense steps and ratio 1.0 stay exact, as Horovod's
    fp16 = mode == "dense_fp16" and k < n
    if mode in DENSE:                     # auto's dense plans: everything (fp16: the rounding stays)
        k = n
    if k == n and not gains:              # density 1 (dense steps, ratio 1.0, auto's dense plans)
        return ("dense_fp16" if fp16 else "dense"), k, k_next, gains
    # a density-1 step that still feeds the gains goes as AR-Topk of everything (values + flag)
    # every rank selects its own top-k (low rank: makes its own P)
    own_topk = mode in ("allgather", "split_reduce", "hierarchical", "lowrank")
    return (mode if own_topk and k < n else "artopk"), k, k_next, gains
