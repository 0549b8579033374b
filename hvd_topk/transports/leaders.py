"""AR-Topk leaders: which rank picks the index set of a tensor for a step, identical on every rank.

- STAR: round robin over steps, offset by the tensor's index, so the selection work spreads over ranks.
- VAR: the rank whose accumulators are largest (EWMA of the squared norm), learned from one asynchronous
  allgather of one float per rank per step; STAR until the first scores arrive.
"""
import torch
from horovod.torch import mpi_ops

from .collectives import wait

__all__ = ["star_leader", "StarLeaders", "VarLeaders", "VAR_EWMA_WEIGHT"]

VAR_EWMA_WEIGHT = 0.1     # weight of the newest step in VAR's score: a few steps' memory, so one odd
                          # batch does not move the leader


def star_leader(key_index, step, size):
    """STAR: round robin over steps, offset by the tensor's index so selection work spreads over ranks."""
    return (step + key_index) % size


class StarLeaders:
    """STAR leaders over keys whose indices (identical on every rank) are given by ``key_index``; ranks
    are counted within ``process_set``."""

    def __init__(self, key_index, process_set=mpi_ops.global_process_set):
        self.key_index = key_index            # key -> int, the same on every rank
        self.process_set = process_set

    def leader(self, key, step):
        return star_leader(self.key_index[key], step, self.process_set.size())

    def observe(self, sq_norm):
        """Nothing to learn: STAR ignores the accumulators."""

    def end_step(self):
        """Nothing to share."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def forget(self):
        """The ranks changed (elastic): nothing of STAR depends on the old ones."""


class VarLeaders(StarLeaders):
    """VAR: the rank with the largest EWMA of its step's squared accumulator norm leads every tensor;
    the lowest rank wins ties. Scores travel in one asynchronous allgather per step, named ``name``."""

    def __init__(self, key_index, name, process_set=mpi_ops.global_process_set):
        super().__init__(key_index, process_set)
        self.name = name
        self.score = 0.0                      # this rank's EWMA of the squared accumulator norm
        self.step_sq_norm = 0.0               # this step's sum so far
        self.scores = None                    # everybody's scores, as gathered after the last step
        self.handle = None                    # the allgather in flight

    def leader(self, key, step):
        self._receive()
        if self.scores is not None:
            return int(torch.argmax(self.scores))
        return super().leader(key, step)

    def observe(self, sq_norm):
        self.step_sq_norm += sq_norm

    def end_step(self):
        """Fold this step's norm into the score and start sharing it (every rank, every step)."""
        self._receive()                       # a step that picked no leader left the last one unread
        if self.process_set.size() > 1:
            self.score = (1 - VAR_EWMA_WEIGHT) * self.score + VAR_EWMA_WEIGHT * self.step_sq_norm
            self.handle = mpi_ops.allgather_async(torch.tensor([self.score], dtype=torch.float64),
                                                  name=f"{self.name}.score", process_set=self.process_set)
        self.step_sq_norm = 0.0

    def _receive(self):
        if self.handle is not None:
            scores = wait(self.handle)                  # None: Horovod was re-initialised since
            self.scores = None if scores is None else scores.reshape(-1)
            self.handle = None

    def forget(self):
        """The ranks changed (elastic): the gathered scores were the old ranks'; STAR until new ones."""
        self.scores, self.handle = None, None

    def state_dict(self):
        self._receive()
        return {"score": self.score, "scores": None if self.scores is None else self.scores.clone()}

    def load_state_dict(self, state):
        self.score, self.scores, self.handle = state["score"], state["scores"], None
        if self.scores is not None:
            self.scores = self.scores.clone()
