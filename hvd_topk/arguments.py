"""What each front door accepts: one place for the checks of the settings (``hvd_topk.settings``:
``TopKSettings``, ``OptimizerSettings``, each checked when made) and of those arguments of
``hvd_topk.DistributedOptimizer`` that need the optimizer.

Every check raises ``ValueError`` naming the argument and the accepted values (``hvd_topk.core.validate``'s
message shape), before anything collective starts, so a bad argument fails alike on every rank. The
automatic choices (``communication='auto'``, ``adaptive_ratio``) are checked where they are built,
in ``hvd_topk.auto``.
"""
import numbers

import torch
from horovod.torch import mpi_ops
from horovod.torch.mpi_ops import Average, Sum

from .core.validate import check_choice, check_int, check_number
from .transports.build import OWN_COLLECTIVES
from .transports.lowrank_wire import VALUES as LOWRANK_VALUES      # PowerSGDSettings.values

__all__ = ["check_topk_settings", "check_lowrank_settings", "check_lowrank_use", "topk_only_settings",
           "check_optimizer_settings", "check_hierarchical", "check_stock_selection", "selection_of", "check_optimizer",
           "check_groups", "STOCK_COMMUNICATIONS", "GLOBAL_STOCK_COMMUNICATIONS", "COMMUNICATIONS", "COMPRESSES",
           "LEADERS", "SELECTIONS", "VALUES"]

STOCK_COMMUNICATIONS = ("split_reduce", "hierarchical", "allgather", "artopk", "dense")     # TopKEF's
COMMUNICATIONS = ("artopk", "allgather", "split_reduce", "hierarchical", "dense", "auto", "lowrank")  # optimizer's
LOWRANK_COMMUNICATIONS = ("lowrank", "hierarchical")        # PowerSGDSettings.communication
PIN_TRANSPORTS = ("dense", "dense_fp16", "artopk", "split_reduce", "allgather", "lowrank")  # OptimizerSettings.pin
COMPRESSES = ("gradient", "update")
SECOND_MOMENTS = ("local", "frozen")
LEADERS = ("star", "var")
SELECTIONS = ("layerwise", "global")      # and None: selection_of's default
# TopKEF's with selection='global': the transports that carry their own values (and dense, which selects nothing)
GLOBAL_STOCK_COMMUNICATIONS = OWN_COLLECTIVES + ("dense",)
VALUES = ("bf16", "fp16", "fp32")          # TopKSettings.values: hvd_topk.core.codec's kinds of float32 values


def check_topk_settings(settings):
    """``TopKSettings``' fields, checked: {name: value as kept (float, int, bool)}."""
    return {"ratio": check_number("ratio", settings.ratio, low=0, high=1, low_open=True,
                                  what="(fraction of elements kept)"),
            "min_numel": check_int("min_numel", settings.min_numel),
            "communication": check_choice("communication", settings.communication, STOCK_COMMUNICATIONS),
            "budget": None if settings.budget is None else
            check_number("budget", settings.budget, low=1, what="(multiple of k kept by split_reduce), or None"),
            "sync_indices": bool(settings.sync_indices),
            "values": check_choice("values", settings.values, VALUES),
            "bucket_cap_mb": check_number("bucket_cap_mb", settings.bucket_cap_mb, low=0,
                                          what="(MB of float32 gradient per bucket; 0: one bucket)"),
            "selection": check_choice("selection", settings.selection, SELECTIONS + (None,))}


def check_lowrank_settings(settings):
    """``PowerSGDSettings``' fields, checked: {name: value as kept (int, float)}."""
    return {"rank": check_int("rank", settings.rank, low=1),
            "min_compression_rate": check_number("min_compression_rate", settings.min_compression_rate, low=0,
                                                 low_open=True, what="(torch's min_compression_rate)"),
            "communication": check_choice("communication", settings.communication, LOWRANK_COMMUNICATIONS),
            "seed": check_int("seed", settings.seed),
            "epsilon": check_number("epsilon", settings.epsilon, low=0),
            "values": check_choice("values", settings.values, LOWRANK_VALUES),
            "dense_steps": check_int("dense_steps", settings.dense_steps)}


def check_lowrank_use(settings, communication, compression_kind):
    """ValueError naming the optimizer's settings that only Top-K has, where low rank is used (the
    compression is low rank, or a tensor is pinned to it), and a ``communication`` of the other kind.

    DGC's momentum correction masks the velocity where entries left whole, and the warm-up, the global
    selection and the adaptive ratio move a density: low rank sends no entry whole and has no density.
    ``compress='update'``, VAR leaders and ``value_dtype`` are Top-K's wire and step alone."""
    if compression_kind == "lowrank" and communication not in LOWRANK_COMMUNICATIONS + ("dense", "auto"):
        raise ValueError(f"communication must be one of {LOWRANK_COMMUNICATIONS + ('dense', 'auto')} with a "
                         f"low-rank compression, got {communication!r} (a Top-K transport: pin it per tensor "
                         "with OptimizerSettings(pin=...), or use compression=hvd_topk.TopKEF)")
    if compression_kind != "lowrank" and communication == "lowrank":
        raise ValueError("communication='lowrank' needs compression=hvd_topk.PowerSGD(...) (or pin tensors to "
                         "it with OptimizerSettings(pin=...))")
    pinned = "lowrank" in (settings.pin or {}).values()
    named = topk_only_settings(settings)
    if named and (compression_kind == "lowrank" or pinned):
        raise ValueError(f"{', '.join(named)} cannot be used with low rank (PowerSGD"
                         f"{' pinned to a tensor' if compression_kind != 'lowrank' else ''}): they are Top-K's "
                         "(DGC's momentum correction, warm-up and selection, the adaptive ratio, the update's "
                         "error feedback, AR-Topk's leader, the values' dtype); leave them at their defaults "
                         "(dense_steps and clip_grad_norm apply to low rank too)")


def dense_steps_of(settings, compression):
    """The optimizer's dense first steps: ``OptimizerSettings.dense_steps`` or the compression's own
    (``PowerSGDSettings.dense_steps``, as the stock door takes them), whichever is set; ValueError
    where both are set and differ (no silent choice between two numbers the user gave)."""
    own, theirs = settings.dense_steps, getattr(compression, "dense_steps", 0)
    if own and theirs and own != theirs:
        raise ValueError(f"dense_steps must be set once: OptimizerSettings(dense_steps={own}) and the "
                         f"compression's dense_steps={theirs} differ (set one, or both alike)")
    return own or theirs


def topk_only_settings(settings):
    """The names of the ``OptimizerSettings`` set away from their defaults that only Top-K has (where
    they are set, ``communication='auto'`` leaves low rank out of its choices)."""
    topk_only = {"momentum_correction": settings.momentum_correction, "warmup_steps": settings.warmup_steps,
                 "warmup_epochs": settings.warmup_epochs, "selection": settings.selection == "global",
                 "adaptive_ratio": settings.adaptive_ratio not in (None, False),
                 "compress": settings.compress != "gradient", "leader": settings.leader != "star",
                 "value_dtype": settings.value_dtype is not None}
    return [name for name, on in topk_only.items() if on]


def check_hierarchical(communication, process_set):
    """ValueError if ``communication`` is hierarchical in a set other than the global one."""
    if communication == "hierarchical" and process_set is not mpi_ops.global_process_set:
        raise ValueError("communication='hierarchical' needs the global process set (it builds its own per host)")


def selection_of(chosen, communication, pinned=False):
    """The selection a step runs: ``'global'`` if one of ``chosen`` (the selections the user gave, None
    where not given) says so, else ``'layerwise'`` if one says so. Neither given (the default): one top-k
    over the step's compressed tensors (``'global'``) where every rank selects its own top-k
    (``OWN_COLLECTIVES``): it reached dense - 1 pt in fewer steps than layer-wise on the MLP and the wide
    CNN, in as few on the embedding model once its table went alone, and ended lower on the LM
    (docs/optimizer.md, ``selection``). Else ``'layerwise'``: AR-Topk (in ``TopKEF`` its values ride
    Horovod's allreduce tensor by tensor; the optimizer follows, so the two doors agree), ``'auto'`` and
    pinned tensors (chosen per tensor), dense and low rank (nothing is selected). ValueError for
    ``'global'`` with pinned tensors: one top-k over all of them leaves no tensor its own transport.

    Example:
        >>> selection_of([None], "split_reduce"), selection_of([None], "artopk"), selection_of(["layerwise"], "allgather")
        ('global', 'layerwise', 'layerwise')
    """
    if "global" in chosen:
        if pinned:
            raise ValueError("selection must be 'layerwise' or None with OptimizerSettings(pin=...), got 'global' "
                             "(one top-k over all compressed tensors leaves no tensor its own transport)")
        return "global"
    if "layerwise" in chosen:
        return "layerwise"
    return "global" if communication in OWN_COLLECTIVES and not pinned else "layerwise"


def check_stock_selection(settings):
    """``TopKEF``'s selection (``selection_of``), or ValueError where it cannot select globally: its global
    selection sends the step's accumulators once all are compressed, through a transport that carries its
    own values; artopk's values ride in Horovod's allreduce, each tensor's as ``compress`` returns them,
    before the step's others exist."""
    if settings.selection == "global" and settings.communication not in GLOBAL_STOCK_COMMUNICATIONS:
        raise ValueError(f"selection must be 'layerwise' or None with communication={settings.communication!r} in "
                         f"TopKEF, got 'global' (TopKEF selects globally with communication one of "
                         f"{GLOBAL_STOCK_COMMUNICATIONS}; hvd_topk.DistributedOptimizer with artopk too)")
    return selection_of([settings.selection], settings.communication)


def check_optimizer_settings(s):
    """``OptimizerSettings``' fields, each alone and together (what needs the optimizer is
    ``check_optimizer``'s): ValueError naming the first bad one; else momentum correction on/off."""
    check_choice("compress", s.compress, COMPRESSES)
    check_choice("selection", s.selection, SELECTIONS + (None,))
    check_choice("leader", s.leader, LEADERS)
    if s.momentum_correction not in (None, False, True):
        raise ValueError(f"momentum_correction must be True or False, got {s.momentum_correction!r}")
    if s.compress == "update" and s.momentum_correction:
        raise ValueError("momentum_correction=True cannot be used with compress='update' (the local "
                         "optimizer keeps its momentum; its update is what is compressed)")
    if not isinstance(s.local_momentum, bool):
        raise ValueError(f"local_momentum must be True or False, got {s.local_momentum!r}")
    if not s.local_momentum and s.compress != "update":
        raise ValueError("local_momentum=False needs compress='update' (with compress='gradient' the "
                         "optimizer steps on the aggregate; see momentum_correction)")
    for name in ("warmup_steps", "warmup_epochs", "dense_steps"):
        check_int(name, getattr(s, name))
    check_choice("second_moment", s.second_moment, SECOND_MOMENTS)
    if s.second_moment == "frozen" and (s.compress != "update" or s.dense_steps < 1):
        raise ValueError(f"second_moment='frozen' needs compress='update' and dense_steps >= 1 (the moment is "
                         f"taken from the dense steps' averaged gradients), got compress={s.compress!r}, "
                         f"dense_steps={s.dense_steps!r}")
    if s.clip_grad_norm is not None:
        check_number("clip_grad_norm", s.clip_grad_norm, low=0, low_open=True, what="or None")
    if s.value_dtype is not None and not (isinstance(s.value_dtype, torch.dtype) and s.value_dtype.is_floating_point):
        raise ValueError(f"value_dtype must be a floating torch dtype or None, got {s.value_dtype!r}")
    if s.adaptive_weight is not None:
        check_number("adaptive_weight", s.adaptive_weight, low=0)
    check_int("auto_every", s.auto_every, low=2)
    if s.pin is not None and not (isinstance(s.pin, dict) and all(
            isinstance(name, str) and transport in PIN_TRANSPORTS for name, transport in s.pin.items())):
        raise ValueError(f"pin must be None or a dict of parameter name -> one of {PIN_TRANSPORTS}, got {s.pin!r}")
    return bool(s.momentum_correction)


def check_optimizer(*, optimizer, settings, communication, backward_passes_per_step, op, gradient_predivide_factor,
                    groups, process_set, grad_scaler):
    """``hvd_topk.DistributedOptimizer``'s arguments beside the settings (``settings``: its
    ``OptimizerSettings``, checked alone when made; the automatic ones are ``hvd_topk.auto``'s), and
    what the settings need of the optimizer: ValueError naming the first bad one."""
    check_choice("communication", communication, COMMUNICATIONS)
    if not settings.local_momentum and any("betas" not in g and "momentum" not in g for g in optimizer.param_groups):
        raise ValueError(f"local_momentum=False needs an optimizer whose param groups have 'betas' (Adam "
                         f"family) or 'momentum' (SGD, RMSprop); {type(optimizer).__name__} has neither")
    if settings.second_moment == "frozen" and (not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or
                                               any(g.get("amsgrad") for g in optimizer.param_groups)):
        raise ValueError(f"second_moment='frozen' needs torch.optim.Adam or AdamW without amsgrad (whose second "
                         f"moment and bias correction it holds), got {type(optimizer).__name__}")
    if settings.compress == "update" and grad_scaler is not None:
        raise ValueError("grad_scaler cannot be used with compress='update' (use it with "
                         "compress='gradient', or unscaled gradients)")
    check_int("backward_passes_per_step", backward_passes_per_step, low=1)
    if op not in (Average, Sum):
        raise ValueError("op must be hvd.Average or hvd.Sum (Adasum is not a sum of sparse vectors)")
    check_number("gradient_predivide_factor", gradient_predivide_factor, low=0, low_open=True)
    if not isinstance(process_set, mpi_ops.ProcessSet) or process_set.process_set_id is None:
        raise ValueError(f"process_set must be a Horovod ProcessSet registered with hvd.init or "
                         f"hvd.add_process_set, got {process_set!r}")
    check_hierarchical(communication, process_set)
    # DGC's correction is SGD's momentum, on the raw gradient; RMSprop's momentum acts after its
    # normalisation, so correcting it would change what the optimizer computes.
    has_momentum = isinstance(optimizer, torch.optim.SGD) and \
        any(g.get("momentum", 0.0) > 0 for g in optimizer.param_groups)
    if settings.momentum_correction and not has_momentum:
        raise ValueError("momentum_correction=True needs an optimizer with momentum > 0: torch.optim.SGD "
                         f"or a subclass (got {type(optimizer).__name__} without SGD's momentum)")
    check_groups(groups, optimizer)


def check_groups(groups, optimizer):
    """ValueError unless ``groups`` is None, an int >= 1 or a list of lists of the optimizer's
    parameters, each at most once (Horovod's accepted values)."""
    if groups is None:
        return
    if isinstance(groups, numbers.Integral) and not isinstance(groups, bool):
        valid = groups >= 1
    else:
        valid = isinstance(groups, list) and all(isinstance(g, (list, tuple)) for g in groups)
    if not valid:
        raise ValueError(f"groups must be None, an integer >= 1 or a list of lists of parameters, got {groups!r}")
    if not isinstance(groups, list):
        return
    mine = {id(q) for group in optimizer.param_groups for q in group["params"]}
    seen = set()
    for group in groups:
        for q in group:
            if not isinstance(q, torch.Tensor) or id(q) not in mine:
                raise ValueError("groups: every entry must be a parameter of the optimizer")
            if id(q) in seen:
                raise ValueError("groups: a parameter can only appear once")
            seen.add(id(q))
