"""The settings both front doors read, each kind in one small frozen dataclass.

- ``TopKSettings``: what Top-K with error feedback is configured with. ``TopKEF(...)`` only checks and
  keeps one (``comp.settings``; the class ``TopKEF`` holds the defaults), and
  ``hvd_topk.DistributedOptimizer(compression=...)`` reads nothing else of the compressor.
- ``PowerSGDSettings``: low rank (PowerSGD), kept the same way by ``hvd_topk.PowerSGD(...)``.
- ``OptimizerSettings``: the optimizer's seldom-tuned settings (DGC's schedule and corrections, what is
  compressed, the wire, the automatic choices), grouped as torch's ``PowerSGDState`` groups its slots,
  so that the factory's own arguments stay Horovod's.

Every compressor kind has its own settings class, a subclass of ``CompressorSettings`` whose ``kind``
names it; ``hvd_topk.transports.build`` builds the transports of each kind from it. Every field is
checked when the settings are made: a bad value raises ValueError naming the field and its accepted
range (``hvd_topk.arguments``), before anything collective starts.
"""
import dataclasses
import warnings
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .arguments import check_lowrank_settings, check_optimizer_settings, check_topk_settings

__all__ = ["CompressorSettings", "TopKSettings", "PowerSGDSettings", "OptimizerSettings", "with_old_keywords",
           "with_value_dtype"]


@dataclass(frozen=True)
class CompressorSettings:
    """What one kind of compressor is configured with; ``kind`` names the kind (a subclass per kind)."""
    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class TopKSettings(CompressorSettings):
    """Top-K with error feedback (``TopKEF``'s arguments of the same names).

    Args:
        ratio: fraction of elements kept per tensor, in (0, 1]; 1.0 sends everything.
        min_numel: tensors with fewer elements go dense, int >= 0.
        communication: the transport, one of ``hvd_topk.arguments.STOCK_COMMUNICATIONS``.
        budget: split_reduce keeps the largest ``budget * k`` summed entries, >= 1; None (default): one k
            per 4 ranks of the exchange, between 1 and 4 (``hvd_topk.core.wire.budget_at``).
        sync_indices: artopk: share the current step's index set by a blocking broadcast.
        values: how split_reduce and allgather send float32 values: ``'bf16'`` (default), ``'fp16'`` (with a
            power-of-two scale per message, so nothing overflows) or ``'fp32'`` (exact; the 8-byte-entry
            results bit for bit). The rounding stays in the residual (``hvd_topk.core.codec``).
        bucket_cap_mb: split_reduce and allgather send their tensors in buckets of at most this many MB of
            float32 gradient (reverse registration order, as DDP), one collective per bucket and phase,
            each bucket leaving once its gradients are ready; > 0, or 0 for one bucket per step.
        selection: ``'layerwise'`` (a top-k per tensor), ``'global'`` (one over the step's compressed
            tensors) or None (default: ``'global'``, with ``'artopk'`` ``'layerwise'``; the optimizer's is
            ``hvd_topk.arguments.selection_of``: global if this or ``OptimizerSettings.selection`` says so).

    Example:
        >>> TopKSettings(ratio=0.001).min_numel
        1024
    """
    kind: ClassVar[str] = "topk"
    ratio: float = 0.01
    min_numel: int = 1024
    communication: str = "split_reduce"
    budget: Optional[float] = None
    sync_indices: bool = False
    values: str = "bf16"
    bucket_cap_mb: float = 25.0
    selection: Optional[str] = None

    def __post_init__(self):
        for name, value in check_topk_settings(self).items():
            object.__setattr__(self, name, value)       # checked and normalised (float, int, bool)


@dataclass(frozen=True)
class PowerSGDSettings(CompressorSettings):
    """Low rank: PowerSGD (Vogels et al., NeurIPS'19) as torch's ``powerSGD_hook`` defines it
    (``hvd_topk.transports.lowrank``; ``PowerSGD``'s arguments of the same names).

    Args:
        rank: the rank r of each tensor's approximation, int >= 1 (torch's ``matrix_approximation_rank``).
        min_compression_rate: a tensor is compressed only if its matrix view (n x m, a conv weight
            out x in*kh*kw) shrinks more than this: n*m > rate * r(n + m); > 0 (torch's 2). Others,
            and 1-D tensors, go dense.
        communication: ``'lowrank'`` (one allreduce of every P, one of every Q, over all ranks) or
            ``'hierarchical'`` (the same sums taken inside each host first: only each host's sum of
            the P's and Q's crosses between hosts).
        seed: the seed of every tensor's first Q, int >= 0 (identical on all ranks).
        epsilon: added to each column's norm in the orthogonalization, >= 0 (torch's
            ``orthogonalization_epsilon``).
        values: how a float32 gradient's P's and Q's go on the wire: ``'fp32'`` (default, as torch's hook
            sends them) or ``'fp16'`` (half the bytes, with a power-of-two scale per tensor from the last
            step's sums, and a sum that overflowed sent again in float32; one more allreduce per step
            where some tensors go dense). Error feedback is exact either way
            (``hvd_topk.transports.lowrank_wire``).
        dense_steps: the first steps go to Horovod's allreduce as they are, int >= 0 (torch's
            ``start_powerSGD_iter``; 0: compressed from the first step). The optimizer door's
            ``OptimizerSettings.dense_steps`` says the same; set both, they must agree.

    Example:
        >>> PowerSGDSettings(rank=2).kind
        'lowrank'
    """
    kind: ClassVar[str] = "lowrank"
    rank: int = 4
    min_compression_rate: float = 2.0
    communication: str = "lowrank"
    seed: int = 0
    epsilon: float = 0.0
    values: str = "fp32"
    dense_steps: int = 0

    def __post_init__(self):
        for name, value in check_lowrank_settings(self).items():
            object.__setattr__(self, name, value)       # checked and normalised (int, float)


@dataclass(frozen=True)
class OptimizerSettings:
    """``hvd_topk.DistributedOptimizer``'s seldom-tuned settings (docs/optimizer.md has each in full).

    Args:
        momentum_correction: DGC momentum correction + factor masking (SGD with momentum only).
        warmup_steps: DGC warm-up over this many steps, int >= 0.
        warmup_epochs: the same per epoch (``opt.set_epoch(epoch)``), int >= 0.
        dense_steps: the first steps send every element (dense Horovod), int >= 0.
        clip_grad_norm: DGC local clipping of each gradient to this norm / sqrt(size), > 0, or None.
        selection: ``'layerwise'`` (a top-k per tensor, each sent once ready) or ``'global'`` (one over all, at
            synchronize()); None (default): TopKEF's, else ``'global'`` with split_reduce, allgather and
            hierarchical, ``'layerwise'`` with artopk, auto or pins (``hvd_topk.arguments.selection_of``).
        compress: ``'gradient'`` or ``'update'`` (error feedback on every rank's own optimizer update).
        local_momentum: with ``compress='update'``, False steps the optimizer without its momentum.
        second_moment: with ``compress='update'`` and Adam/AdamW: ``'local'`` (each rank's own) or
            ``'frozen'`` (taken from the dense steps' averaged gradients, then held: 1-bit Adam's).
        leader: AR-Topk's leader, ``'star'`` (round robin) or ``'var'`` (largest accumulators).
        value_dtype: deprecated: ``TopKEF(values=...)`` says how split_reduce and allgather send values
            (float16 here means ``values='fp16'``, bfloat16 ``'bf16'``, float32 ``'fp32'``); artopk's and the
            dense allreduces' values still go in this dtype. None: the defaults.
        adaptive_ratio: None/False, True or (low, high): the ratio moves among candidates (``hvd_topk.auto``).
        adaptive_weight: exponent of the gain in the adaptive ratio's objective, and of the quality where auto
            weighs low rank against Top-K, >= 0; None: 0.3 and 1.0 (measured: docs/auto.md).
        auto_every: steps between the automatic checks, int >= 2.
        pin: {parameter name: transport}: these tensors always go with that transport (``'dense'``,
            ``'dense_fp16'``: every entry in fp16, the rounding kept in the residual (through the hosts
            under ``communication='hierarchical'``: each host's sum crosses once), ``'artopk'``,
            ``'split_reduce'``, ``'allgather'``, ``'lowrank'``), whatever ``communication`` says or
            ``'auto'`` would choose; None: none pinned.

    Example:
        >>> OptimizerSettings(warmup_epochs=4).warmup_epochs
        4
    """
    # DGC: the density schedule and the local corrections
    momentum_correction: bool = False
    warmup_steps: int = 0
    warmup_epochs: int = 0
    dense_steps: int = 0
    clip_grad_norm: Optional[float] = None
    # what goes through error feedback, and how it is selected
    selection: Optional[str] = None
    compress: str = "gradient"
    local_momentum: bool = True
    second_moment: str = "local"
    # the wire
    leader: str = "star"
    value_dtype: Optional[torch.dtype] = None
    # the automatic choices (hvd_topk.auto)
    adaptive_ratio: object = None
    adaptive_weight: Optional[float] = None
    auto_every: int = 50
    # per tensor: a transport that no communication or automatic choice overrides
    pin: Optional[dict] = None

    def __post_init__(self):
        object.__setattr__(self, "momentum_correction", check_optimizer_settings(self))
        if self.pin is not None:
            object.__setattr__(self, "pin", dict(self.pin))     # checked; a copy the caller cannot change


def with_old_keywords(settings, keywords):
    """``settings`` (None: the defaults) with the optimizer's old keyword arguments applied on top, each
    with a DeprecationWarning that names the new spelling; TypeError for a keyword that never existed.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     with_old_keywords(None, {"warmup_steps": 5}).warmup_steps
        5
    """
    settings = OptimizerSettings() if settings is None else settings
    if not isinstance(settings, OptimizerSettings):
        raise ValueError(f"settings must be a hvd_topk.OptimizerSettings or None, got {settings!r}")
    fields = {f.name for f in dataclasses.fields(OptimizerSettings)}
    for name in keywords:
        if name not in fields:
            raise TypeError(f"DistributedOptimizer() got an unexpected keyword argument {name!r}")
        warnings.warn(f"hvd_topk.DistributedOptimizer({name}=...) is deprecated: pass "
                      f"settings=hvd_topk.OptimizerSettings({name}=...)", DeprecationWarning, stacklevel=3)
    return dataclasses.replace(settings, **keywords) if keywords else settings


def with_value_dtype(topk, value_dtype):
    """``topk`` (``TopKSettings``) with its ``values`` spelt by the deprecated ``OptimizerSettings.value_dtype``
    (a DeprecationWarning naming the new spelling); unchanged for None.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     with_value_dtype(TopKSettings(), torch.float16).values
        'fp16'
    """
    if value_dtype is None:
        return topk
    values = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(value_dtype, "fp32")
    warnings.warn(f"hvd_topk.OptimizerSettings(value_dtype={value_dtype}) is deprecated: pass "
                  f"compression=hvd_topk.TopKEF(values={values!r}) (artopk's and the dense allreduces' values "
                  "still go in value_dtype)", DeprecationWarning, stacklevel=3)
    return dataclasses.replace(topk, values=values)
