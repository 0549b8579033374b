"""What every compressor for stock ``hvd.DistributedOptimizer`` shares: ``CompressorDoor``, the base of
``TopKEF`` and ``PowerSGD``.

Horovod's ``Compressor`` contract is two static calls per gradient: ``compress(tensor) -> (tensor, ctx)``
before its allreduce and ``decompress(reduced, ctx)`` after it, and within a step Horovod compresses
every gradient before it decompresses any. A door adds to it, the same way for every kind:

- which parameter a gradient is (``gradient_keys``: by name, or by position in the step);
- its residual (``ResidualMemory``), committed only when the step was finite on every rank
  (``PendingStep``): a non-finite gradient anywhere hands out every gradient of the step as NaN on
  every rank, with every residual untouched;
- a failed check of the gradient sequence ends the job instead of hanging it (``ends_job_on_mismatch``);
- ``compression=Door`` (the class) means one default instance (``ClassOrInstance``).

A door only says how a gradient leaves (``_compress``) and how its reduction comes back (``_receive``);
the transports it drives are ``hvd_topk.transports``' (the optimizer's), behind ``op_token`` where they
run their own collectives.
"""
import contextlib
import os
import sys
import threading
import time
from typing import NamedTuple

import torch
from horovod.torch import mpi_ops
from horovod.torch.compression import Compressor

from .gradient_keys import ParameterKeys, SlotSequence
from .op_token import OpToken
from .schedule import DoorSteps
from ..core.memory import ResidualMemory, StepCommits
from ..core.sparsify import sq_norm_finite
from ..core.validate import check_number
from ..transports.collectives import ranks_share_cores

__all__ = ["ClassOrInstance", "CompressorDoor", "FailedCompress", "PendingStep", "SHUTDOWN_GRACE_S",
           "ends_job_on_mismatch", "report_mismatch", "after_backward", "keys_and_residuals", "load_keys_and_residuals"]

REPORT_GRACE_S = 2.0          # time the ranks that failed the same check get to write it before one exits


def _shutdown_grace_s(default=15.0):
    """HVD_TOPK_SHUTDOWN_GRACE_S, read when the doors are first imported, else ``default``.

    Why a setting: 15 s lets a rank of a loaded job reach the same check and name the cause itself; an
    idle cluster (or a test suite) can end a failed job sooner, a crowded one later. Below 3 s the
    shutdown could overtake REPORT_GRACE_S, and the ranks that failed would end without naming the cause."""
    text = os.environ.get("HVD_TOPK_SHUTDOWN_GRACE_S")
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = text                    # not a number: check_number names it as given
    return check_number("HVD_TOPK_SHUTDOWN_GRACE_S", value, low=3, high=600,
                        what=f"(seconds; unset: {default:g})")


SHUTDOWN_GRACE_S = _shutdown_grace_s()   # time the other ranks get to reach the same check and raise it


class ClassOrInstance:
    """Binds a method to the class's default instance when called on the class itself.

    Horovod calls ``compression.compress(tensor)``; with ``compression=TopKEF`` that is a call on the
    class, which then uses one shared default instance (``default()``)."""

    def __init__(self, fn):
        self._fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls):
        return self._fn.__get__(cls.default() if obj is None else obj, cls)


@contextlib.contextmanager
def ends_job_on_mismatch():
    """A check of this rank's gradient sequence failed (ValueError). Where the other ranks fail the
    same check, each raises it; a rank that does not may be waiting in a collective this rank will
    never join. So Horovod is shut down SHUTDOWN_GRACE_S seconds after the error is raised: that
    rank's collective then fails too, and the job ends instead of hanging. (Alone, no rank waits.)

    The launcher kills every rank once one has exited, so a rank writes its error at once and raises it
    only REPORT_GRACE_S later: a rank that failed the same check a little later (a loaded machine)
    still gets to say so itself, and every rank's log names the cause."""
    try:
        yield
    except ValueError as error:
        if mpi_ops.size() == 1:
            raise
        report_mismatch(error)
        time.sleep(REPORT_GRACE_S)
        raise


def report_mismatch(error):
    """Write ``error`` now and shut Horovod down SHUTDOWN_GRACE_S seconds later (``ends_job_on_mismatch``)."""
    timer = threading.Timer(SHUTDOWN_GRACE_S, mpi_ops.shutdown)
    timer.daemon = True
    timer.start()
    print(f"hvd_topk: rank {mpi_ops.rank()}: {error}", file=sys.stderr, flush=True)


class FailedCompress(NamedTuple):
    """The ctx of a gradient whose ``compress`` failed a check: ``decompress`` raises the step's error."""
    shape: tuple
    dense: bool = False
    key: str = "failed"


class PendingStep(StepCommits):
    """One Horovod step's new residuals (``StepCommits``); if some gradient was non-finite on some rank,
    every gradient of the step is handed out all NaN."""

    def __init__(self):
        super().__init__()
        self.outputs = []                     # the step's decompressed gradients, as handed to Horovod
        self.failure = None                   # the ValueError a compress of this step raised, if one did

    def hand_out(self, out, finite, like, shape):
        if not finite and not self.nonfinite:
            self.nonfinite = True
            for earlier in self.outputs:      # Horovod set_() them into p.grad: NaN them there
                earlier.fill_(float("nan"))
        if self.nonfinite:
            out = torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
        self.outputs.append(out)
        return out


class CompressorDoor(Compressor):
    """A stock-Horovod ``Compressor`` over hvd_topk's transports (module docstring). A subclass gives
    ``settings`` (its class's: the defaults) and three methods: ``_compress(tensor) -> (tensor, ctx)``;
    ``_receive(reduced, ctx) -> (flat aggregate or None where some rank was non-finite, new residual or
    None)`` for a gradient that did not go to Horovod's allreduce as it is; ``_forget()``, which drops what
    the transports shared with the ranks of an abandoned step.

    Args:
        settings: the door's ``hvd_topk.settings.CompressorSettings`` (checked when made).
        named_parameters: ``model.named_parameters()``: state keyed by name; None: by position in the step.
        process_set: the ranks Horovod reduces over (the optimizer's ``process_set``).

    The context a subclass returns from ``_compress`` has ``dense`` (True: the tensor went to Horovod's
    allreduce as it is), ``key`` (None: not part of the step) and ``shape``.
    """

    def __init__(self, settings, named_parameters=None, process_set=mpi_ops.global_process_set):
        self.settings, self.process_set = settings, process_set
        door = type(self).__name__                                     # what the keys' errors name
        self.keys = SlotSequence(door) if named_parameters is None else ParameterKeys(named_parameters, door)
        self.memory, self._step = ResidualMemory(), PendingStep()     # key -> residual; this step's candidates
        self._world_size = None           # the process set's size when the last key was handed out
        self.steps = DoorSteps()          # steps ended (PowerSGD's first settings.dense_steps go dense)

    @classmethod
    def default(cls):
        """The instance used when the class itself is passed as ``compression=``."""
        if "_default_instance" not in cls.__dict__:
            cls._default_instance = cls()
        return cls._default_instance

    def _next_key(self, tensor):
        """The key of ``tensor``'s parameter; after an abandoned step (a failed collective, an elastic
        reset) the step's candidates and what the transports shared are dropped first: the failure may
        have stopped each rank at another point of that step."""
        key = self.keys.next_key(tensor)
        if getattr(self.keys, "interrupted", False):
            self._step, self.keys.interrupted = PendingStep(), False
            self._forget()
        # An elastic reset that added or removed ranks need not interrupt a step (Horovod resets at a
        # commit), but a rank that joined has no buckets, warm starts or index sets: every rank drops
        # what the old set shared, at its first key after the reset, so all start alike.
        size = self.process_set.size()
        if size != self._world_size:
            if self._world_size is not None:
                self._forget()
            self._world_size = size
        return key

    @ClassOrInstance
    def compress(self, tensor):
        """Horovod contract: ``(tensor_to_allreduce, ctx)`` (the subclass's ``_compress``).

        A check that fails here (a fused bucket's frames, read during the backward pass) is raised at
        the step's first ``decompress``, not here: raised in a backward hook, it would stop this rank
        before it handed Horovod the step's other gradients, and the ranks waiting for them would end
        at the shutdown without learning why. Until then Horovod gets a token that fails every other
        rank's key check, so each of them raises the error too, naming the fix."""
        try:
            out = self._compress(tensor)
        except ValueError as error:
            sent = None if mpi_ops.size() == 1 else self._failed_payload(tensor)
            if sent is None:                   # alone, or a transport whose payload no token stands in for
                with ends_job_on_mismatch():
                    raise
            if self._step.failure is None:
                report_mismatch(error)
                self._step.failure = error
            return sent, FailedCompress(tuple(tensor.shape))
        self._after_compress()
        return out

    def _failed_payload(self, tensor):
        """What Horovod allreduces for ``tensor`` after its ``compress`` failed: what every rank sends for
        that parameter, the tensor itself where it goes dense, else the token that fails the key check
        (``OpToken.failed``); None to raise at once (the subclass's payload is not a token)."""
        return OpToken(self.process_set).failed(tensor)

    @ClassOrInstance
    def decompress(self, tensor, ctx):
        """Horovod contract: the dense aggregated gradient. The step's residuals are committed when
        its last gradient is decompressed, and only if every gradient was finite on every rank."""
        if ctx is None or (ctx.dense and ctx.key is None):
            return tensor        # Horovod's sparse allreduce (ctx None), or non-floating: not of the step
        if self._step.failure is not None:     # a compress of this step failed a check (compress)
            failure, self._step = self._step.failure, PendingStep()
            time.sleep(REPORT_GRACE_S)
            raise failure
        # The checks raise only on the ranks that see the mismatch (the token's: only the optimizer's
        # process set); the shutdown ends any rank left waiting for them.
        with ends_job_on_mismatch():
            self.keys.finish_one()
            received = None if ctx.dense else self._receive(tensor, ctx)
        if ctx.dense:
            out = tensor
            finite = sq_norm_finite(tensor.reshape(-1))[1]     # the sum: identical on all ranks
        else:
            out, residual = received
            finite = out is not None
            if finite:
                out = out.reshape(ctx.shape)
            self._step.add(lambda key=ctx.key, residual=residual: self.memory.update(key, residual))
        out = self._step.hand_out(out, finite, tensor, ctx.shape)
        if self.keys.pending == 0:             # Horovod compresses all before it decompresses any
            self._end_step()
        return out

    def _after_compress(self):
        """After each ``compress`` (TopKEF: the step's last one shares AR-Topk's index sets)."""

    def _last_compress_may_drain(self):
        """Whether this ``compress`` was the step's last (from the second step on) and the ranks share
        cores: then the step's collectives may run asleep once the backward pass ends (``after_backward``;
        TopKEF's global selection, PowerSGD), rather than after Horovod's spinning ``synchronize()``."""
        return self._step.failure is None and self.keys.step_complete() and ranks_share_cores()

    def _end_step(self):
        """The step's last gradient was decompressed: its residuals are committed if it was finite."""
        self._step.end()
        self.steps.end()


def after_backward(fn):
    """Call ``fn()`` once the backward pass under way has ended, or now outside one.

    Why: a stock door's step-end work (draining the step's collectives, asleep) must not hold back the
    gradient Horovod is about to allreduce: called inside the last ``compress``, it delays that token
    until the phases are done, and the tokens' round then comes after the phases instead of beside
    them. torch's autograd engine runs queued callbacks after the last hook of the pass (DDP's reducer
    finishes its buckets the same way), by then Horovod has sent every gradient of the step. Outside a
    backward pass (Horovod's ``synchronize()`` compressing a gradient the pass did not produce, or a
    direct call) torch refuses the callback, and ``fn`` runs at once."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    try:
        engine.queue_callback(fn)
    except (RuntimeError, AttributeError):   # not in a backward pass; or a torch without this engine API
        fn()


def keys_and_residuals(door):
    """What every door's ``state_dict`` holds: its key signatures (keys by position), this rank's residuals
    and the steps it has ended."""
    return {"signatures": list(getattr(door.keys, "signatures", [])), "residuals": door.memory.state_dict(),
            "steps_done": door.steps.done}


def load_keys_and_residuals(door, state):
    """Restore ``keys_and_residuals``' part of ``state`` into ``door``: its next compress starts a step."""
    door.keys.restore(state["signatures"])
    door.memory.load_state_dict(state["residuals"])
    # a state saved before the steps were kept: its job compressed from the first step, so it is past them
    door.steps.reset(state.get("steps_done", getattr(door.settings, "dense_steps", 0)))
