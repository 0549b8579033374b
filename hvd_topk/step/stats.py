"""Per-step figures of hvd_topk.DistributedOptimizer, and an optional TensorBoard writer."""

__all__ = ["StepStats", "write_tensorboard"]


class StepStats:
    """Counts one step as it happens; ``last()`` gives the finished step's figures.

    bytes_sent: payload this rank hands to the collectives (values, flags, indices; headers and the
    collective's own fan-out excluded: the link counters of the benchmarks, ``testbed/wire.py``, measure those).
    compression_gain: ||sent||^2 / ||acc||^2 over the compressed tensors (GraVAC's gain).
    split_kept, split_imbalance (split_reduce only): rows the owners kept, over all its tensors, and how
    many rows the busiest owner of each tensor kept, summed, over the mean per owner (1.0: balanced
    regions; P: one owner kept everything).
    """

    def __init__(self):
        self._reset()
        self._last = {}

    def _reset(self):
        self.bytes_sent = 0
        self.sent_sq = 0.0
        self.acc_sq = 0.0
        self.select_s = 0.0
        self.dense_tensors = 0
        self.sparse_tensors = 0
        self.skipped = False
        self.split = None                 # [rows kept, busiest owners' rows, ranks] once split_reduce ran

    def add_sent(self, nbytes, sent_sq, acc_sq, select_s=0.0, dense=False):
        """Record one tensor's contribution to this step."""
        self.bytes_sent += nbytes
        self.sent_sq += sent_sq
        self.acc_sq += acc_sq
        self.select_s += select_s
        if dense:
            self.dense_tensors += 1
        else:
            self.sparse_tensors += 1

    def add_split(self, kept, busiest, ranks, nbytes):
        """Record one split_reduce tensor: rows kept, the busiest owner's rows, the ranks and the payload
        of its histogram and allgather."""
        self.bytes_sent += nbytes
        last = self.split or [0, 0, ranks]
        self.split = [last[0] + kept, last[1] + busiest, ranks]

    def end_step(self, density, comm_s=0.0):
        """Close the step."""
        self._last = {"bytes_sent": self.bytes_sent, "density": density,
                      "compression_gain": self.sent_sq / self.acc_sq if self.acc_sq > 0 else 1.0,
                      "select_s": self.select_s, "comm_s": comm_s,
                      "dense_tensors": self.dense_tensors, "sparse_tensors": self.sparse_tensors,
                      "skipped": self.skipped}
        if self.split is not None:
            kept, busiest, ranks = self.split
            self._last.update(split_kept=kept, split_imbalance=busiest * ranks / kept if kept else 1.0)
        self._reset()

    def last(self):
        """Dict of the last finished step's figures."""
        return dict(self._last)


def write_tensorboard(writer, stats, step):
    """Write a ``stats()`` dict to a ``torch.utils.tensorboard.SummaryWriter`` under hvd_topk/."""
    for key, value in stats.items():
        writer.add_scalar(f"hvd_topk/{key}", float(value), step)
