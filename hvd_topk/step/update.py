"""compress='update': every rank steps the wrapped optimizer on its own gradient, and what is sent is
the change it made to the parameters (the update), through error feedback and the transport.

For Adam-type optimizers, whose per-element normalisation undoes error feedback on gradients (an
element sent once every 100 steps moves a few steps' worth, not 100). The parameters stay identical on
every rank: all start from the same values, put their own update back, and add the same aggregate.

The dense steps (``dense_steps``) are dense Horovod's: the gradients averaged, the optimizer stepped on
the average on every rank, so that every rank's optimizer state is dense's when compression begins (the
frozen second moment, ``hvd_topk.step.second_moment``, is taken from it). The residuals are not touched
there; one a resume brought along goes out with the first compressed step.
"""
import contextlib
import time
import warnings

import torch
from horovod.torch import mpi_ops
from horovod.torch.mpi_ops import Sum

from ..transports.collectives import wait
from .dgc import clip_local
from .second_moment import frozen

__all__ = ["update_step"]


def update_step(opt, closure):
    """compress='update': the wrapped optimizer steps on this rank's gradient; its change of every
    parameter goes through error feedback and the transport, and the aggregate is added on every rank
    (the parameters stay identical: all start from the same values and add the same aggregate)."""
    state = opt._hvd_topk
    t0 = time.perf_counter()
    params = [q for group in opt.param_groups for q in group["params"]
              if q.requires_grad and q.grad is not None]
    # Agree on finiteness before anything changes: a non-finite gradient on any rank skips the step on
    # every rank, with the local optimizer's state (Adam's moments) and the residuals untouched.
    bad = sum(1 for q in params
              if not bool(torch.isfinite(q.grad.coalesce().values() if q.grad.is_sparse else q.grad).all()))
    if wait(mpi_ops.allreduce_async(torch.tensor([float(bad)]), name="hvd_topk.update.finite", op=Sum,
                                    process_set=opt.process_set)).item() > 0:
        state.commits.nonfinite = True
        state.end_step(comm_s=time.perf_counter() - t0)
        warnings.warn("hvd_topk: a gradient was non-finite on some rank; the step is skipped on every "
                      "rank; the optimizer's state and the residuals are unchanged")
        return None
    if state.clip_grad_norm is not None:
        for q in params:
            q.grad.copy_(clip_local(q.grad, state.clip_grad_norm, opt.process_set.size()))
    if state.step < state.schedule.dense_steps:
        return _dense_step(opt, closure, params, t0)
    before = [q.detach().clone() for q in params]
    dense = state.schedule.density(state.step) >= 1.0
    saved = [] if state.local_momentum or dense else _drop_momentum(opt.param_groups)
    try:
        with frozen(opt) if state.second_moment == "frozen" else contextlib.nullcontext():
            loss = super(opt.__class__, opt).step(closure)
    finally:
        for group, key, value in saved:
            group[key] = value
    finishes = []
    with torch.no_grad():
        for q, q0 in zip(params, before):
            update = q.sub(q0)
            q.copy_(q0)                        # bit for bit the value every rank holds
            finishes.append((q, state.submit(q, opt._parameter_names.get(q), update=update)))
        outs = [(q, finish()) for q, finish in finishes]
        if state.end_step(comm_s=time.perf_counter() - t0):
            warnings.warn("hvd_topk: an update was non-finite on some rank (its gradients were finite); it "
                          "is applied on no rank and residuals are unchanged, but the optimizers' own "
                          "states have taken the step")
            return loss
        for q, out in outs:
            q.add_(out)
    return loss


def _dense_step(opt, closure, params, t0):
    """A dense step: every gradient averaged (the plain allreduce, no residual), then the wrapped
    optimizer steps on the average, the same on every rank (dense Horovod's step)."""
    state = opt._hvd_topk
    started = []
    for q in params:
        grad = (q.grad.to_dense() if q.grad.is_sparse else q.grad).reshape(-1)
        started.append((q, state.transports["plain"].start(opt._parameter_names.get(q), grad)))
        state.stats.add_sent(started[-1][1].nbytes, 0.0, 0.0, dense=True)
    averages = [(q, sent.finish().aggregate) for q, sent in started]
    # the gradients were finite everywhere (agreed before); a sum that overflowed is not
    state.commits.nonfinite = any(average is None for _, average in averages)
    if state.end_step(comm_s=time.perf_counter() - t0):
        warnings.warn("hvd_topk: an averaged gradient was non-finite; the step is skipped on every rank")
        return None
    for q, average in averages:
        q.grad = average.reshape(q.shape)
    return super(opt.__class__, opt).step(closure)


def _drop_momentum(param_groups):
    """Set every group's momentum to 0 (Adam's beta1, SGD's or RMSprop's momentum) for one step;
    returns (group, key, value) to restore."""
    saved = []
    for group in param_groups:
        if "betas" in group:
            saved.append((group, "betas", group["betas"]))
            group["betas"] = (0.0, *tuple(group["betas"])[1:])
        else:
            saved.append((group, "momentum", group["momentum"]))
            group["momentum"] = 0.0
    return saved
