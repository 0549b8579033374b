"""The density schedule: what fraction of each compressed tensor a step sends.

Density 1 for the first ``dense_steps`` steps (a plain allreduce: dense Horovod); then DGC's warm-up,
``ratio ** ((t + 1) / (W + 1))`` for the first W steps after them (or per epoch, for the first W epochs);
then ``ratio``. The adaptive ratio moves ``ratio`` through ``change_ratio``: a new ratio takes effect two
steps after the decision, so the AR-Topk index set prepared one step ahead already has the new size.
Identical on every rank: it depends only on step and epoch counters every rank shares.

A stock door counts its steps itself (``DoorSteps``): Horovod's optimizer tells a ``Compressor`` nothing
of them, and elastic Horovod restores the user's state, not the compressor's.
"""
import torch
from horovod.torch import mpi_ops

from ..core.sparsify import k_for
from ..transports.collectives import wait

__all__ = ["DensitySchedule", "DoorSteps"]


class DensitySchedule:
    """Density per step; ``ratio`` is the target fraction kept, in (0, 1]."""

    def __init__(self, ratio, dense_steps=0, warmup_steps=0, warmup_epochs=0):
        self.ratio = ratio                    # moved by the adaptive ratio (identical on all ranks)
        self.configured_ratio = ratio         # TopKEF(ratio=...) as given: tells a resume with a new ratio
        self.ratio_change = None              # (first step, ratio): a decided change not yet in effect
        self.dense_steps = dense_steps        # the first steps send everything
        self.warmup_steps, self.warmup_epochs = warmup_steps, warmup_epochs
        self.epoch = 0                        # set by the optimizer's set_epoch()

    def density(self, step):
        """Density of ``step``, with the ratio in effect at that step."""
        ratio = self.ratio_change[1] if self.ratio_change and step >= self.ratio_change[0] else self.ratio
        return self.density_with(ratio, step)

    def density_with(self, ratio, step):
        """Density of ``step`` if ``ratio`` were the target (the adaptive ratio weighs candidates)."""
        if step < self.dense_steps:
            return 1.0
        if self.warmup_epochs and self.epoch < self.warmup_epochs:
            return ratio ** ((self.epoch + 1) / (self.warmup_epochs + 1))
        if step - self.dense_steps < self.warmup_steps:
            return ratio ** ((step - self.dense_steps + 1) / (self.warmup_steps + 1))
        return ratio

    def k(self, numel, step):
        """Entries a tensor of ``numel`` elements sends at ``step``."""
        return k_for(numel, self.density(step))

    def change_ratio(self, change):
        """Schedule ``change`` = (first step, ratio), or nothing if None."""
        if change is not None:
            self.ratio_change = change

    def advance(self, next_step):
        """The step counter moved to ``next_step``: a scheduled ratio takes effect."""
        if self.ratio_change is not None and next_step >= self.ratio_change[0]:
            self.ratio, self.ratio_change = self.ratio_change[1], None

    def state_dict(self):
        return {"ratio": self.ratio, "ratio_change": self.ratio_change, "epoch": self.epoch,
                "configured_ratio": self.configured_ratio}

    def load_state_dict(self, state):
        """Restore the ratio in use (the adaptive ratio may have moved it), unless the checkpoint was
        written with another configured ratio: then the user chose a new one, and it applies from the
        next step (the residuals stay valid error feedback whatever k sends them; a pending AR-Topk
        index set of the old size is replaced by a spread set of the new size, the same on every rank)."""
        self.epoch = state["epoch"]
        if state.get("configured_ratio", state.get("ratio", self.ratio)) != self.configured_ratio:
            return
        self.ratio = state.get("ratio", self.ratio)
        self.ratio_change = state.get("ratio_change")


class DoorSteps:
    """The steps a stock door has ended (``done``), the same on every rank where a decision rests on them
    (PowerSGD's dense first steps).

    Why a collective: after an elastic reset a rank that joined has counted none, and a rank that sends a
    whole gradient where the others send a token fails Horovod's allreduce. So where the ranks may
    disagree (a job's first step, after a reset or a load) ``agreed`` takes the largest count of the
    ranks, once, in a collective every rank reaches at the same point: its first gradient since then."""

    def __init__(self):
        self.done = 0
        self._agreed = False

    def end(self):
        self.done += 1

    def reset(self, done=None):
        """After a reset (``done`` None: keep the count) or a load: agree again before the next decision."""
        self.done = self.done if done is None else done
        self._agreed = False

    def agreed(self, name, process_set):
        """``done``, the largest among the ranks of ``process_set`` (collective the first time after a reset)."""
        if not self._agreed and process_set.size() > 1:
            largest = mpi_ops.allreduce_async(torch.tensor([self.done], dtype=torch.int64), op=mpi_ops.Max,
                                              name=name, process_set=process_set)
            self.done = int(wait(largest)[0])
        self._agreed = True
        return self.done
