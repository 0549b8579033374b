"""What digits_cnn.py and char_lm.py share: their compression and run flags, and the run log.

The examples import it as ``from common import ...`` (``python examples/x.py`` puts examples/ on
sys.path). Each script builds its distributed optimizer from the flags with ``distributed_optimizer``
(``hvd.DistributedOptimizer`` with Horovod's compression, ``TopKEF`` or ``PowerSGD``, or
``hvd_topk.DistributedOptimizer``, with ``hvd_topk_options(args)`` for its many options), then runs a
training loop built on the run log:

    p = argparse.ArgumentParser()
    add_compression_args(p); add_run_args(p)
    args = p.parse_args(); check_compression_args(p, args)
    opt, comp = distributed_optimizer(args, model, base)      # comp: the stock door's compressor, or None
    log = RunLog(args, example="digits_cnn", model=model, model_name="cnn", dataset="digits")
    log.start()                                   # barrier; the clock and the link counters start
    while not log.should_stop(log.step):          # --max-steps / --time-budget, same on every rank
        log.begin_step()
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        log.end_step(opt, loss)                   # step time, link bytes, opt.stats(), TensorBoard
        if log.eval_due(epoch_end=...):
            with log.paused():                    # evaluation is not training time
                test_loss, test_acc = evaluate(model)
            log.eval_point(log.step, epoch, test_loss, test_acc)
    log.finish(model, {"test_loss": test_loss, "test_accuracy": test_acc})   # checks, JSON

Bytes come from the loopback's kernel counters (``loopback_tx_bytes``): run the job in a private
network namespace (``python -m bench demo`` and the benchmarks do) so that they count this job's
traffic only, every rank's together.
"""
import contextlib
import json
import logging
import time

import horovod.torch as hvd
import torch

import hvd_topk
import hvd_topk.step.stats

__all__ = ["COMPRESSIONS", "add_compression_args", "add_run_args", "check_compression_args", "distributed_optimizer",
           "hvd_topk_options", "loopback_tx_bytes", "RunLog"]

# stock Horovod's own; hvd_topk's compressors in stock Horovod; hvd_topk's optimizer with Top-K or low rank
COMPRESSIONS = ["none", "fp16", "topkef", "powersgd", "hvd_topk", "hvd_topk_powersgd"]


def add_compression_args(parser):
    """Add the compression flags: --compression, --ratio, --min-numel and hvd_topk's options."""
    g = parser.add_argument_group("compression")
    g.add_argument("--compression", choices=COMPRESSIONS, default="topkef",
                   help="none/fp16: stock Horovod; topkef, powersgd: hvd_topk.TopKEF or hvd_topk.PowerSGD in stock "
                        "Horovod; hvd_topk, hvd_topk_powersgd: hvd_topk.DistributedOptimizer with Top-K or low rank")
    g.add_argument("--ratio", type=float, default=0.01, help="Top-K: fraction of elements kept")
    g.add_argument("--min-numel", type=int, default=1024, help="Top-K: smaller tensors go dense")
    g.add_argument("--powersgd-rank", type=int, default=None,
                   help="low rank: the rank r of each tensor's approximation (default 4)")
    g.add_argument("--groups", type=int, default=0,
                   help="Horovod's groups: the gradients split into N groups, each sent as one grouped collective "
                        "once all its gradients are ready (fewer, larger messages); 0: no groups")
    g.add_argument("--communication", choices=["artopk", "allgather", "split_reduce", "hierarchical", "lowrank", "dense",
                                               "auto"], default=None,
                   help="the transport (default: split_reduce for Top-K, lowrank for low rank; auto: hvd_topk's optimizer "
                        "only): artopk (AR-Topk: one shared index set, values allreduced), allgather "
                        "(every rank's own top-k gathered), split_reduce (Ok-Topk: top-k rows to their index "
                        "region's owner, reduced there, the kept rows gathered), hierarchical (dense inside each host, "
                        "compressed across hosts; needs HOROVOD_DYNAMIC_PROCESS_SETS=1), lowrank (PowerSGD's P's and Q's "
                        "allreduced), dense, or auto (chosen per tensor from a probe of the link and timed trials)")
    g.add_argument("--leader", choices=["star", "var"], default="star", help="hvd_topk: AR-Topk leader")
    g.add_argument("--budget", type=float, default=None,
                   help="topkef and hvd_topk: split_reduce keeps the largest budget * k summed entries (>= 1; "
                        "default: one k per 4 ranks, between 1 and 4)")
    g.add_argument("--selection", choices=["layerwise", "global"], default=None,
                   help="hvd_topk: top-k per tensor, or over all compressed tensors at once "
                        "(default: global, per tensor with artopk, auto or pins)")
    g.add_argument("--momentum-correction", choices=["on", "off"], default="off",
                   help="hvd_topk: DGC momentum correction (on: SGD with momentum only)")
    g.add_argument("--warmup-epochs", type=int, default=0, help="hvd_topk: DGC warm-up epochs")
    g.add_argument("--compress", choices=["gradient", "update"], default="gradient",
                   help="hvd_topk: compress the gradients (the optimizer steps on their aggregate) or every "
                        "rank's own optimizer update (for Adam; the optimizer's state is then per rank)")
    g.add_argument("--local-momentum", choices=["on", "off"], default="on",
                   help="hvd_topk, --compress update: off steps the optimizer without momentum (Adam's beta1 = 0) "
                        "once steps are compressed; error feedback's accumulation takes its place")
    g.add_argument("--second-moment", choices=["local", "frozen"], default="local",
                   help="hvd_topk, --compress update, Adam/AdamW: frozen takes Adam's second moment from the "
                        "--dense-steps' averaged gradients and holds it (1-bit Adam's); local: each rank's own")
    g.add_argument("--value-dtype", choices=["float32", "float16"], default="float32",
                   help="hvd_topk: dtype of the compressed tensors' values on the wire")
    g.add_argument("--dense-steps", type=int, default=0,
                   help="hvd_topk and powersgd: send the first N steps dense (a warm-up stage for Adam's statistics; "
                        "torch's start_powerSGD_iter)")
    g.add_argument("--adaptive-ratio", action="store_true",
                   help="hvd_topk: let the optimizer adapt the ratio (--ratio is the starting point)")
    g.add_argument("--adaptive-weight", type=float, default=None,
                   help="hvd_topk: exponent w of the gain in the adaptive ratio's objective (default: the optimizer's)")
    g.add_argument("--auto-every", type=int, default=50,
                   help="hvd_topk: steps between the automatic checks (adaptive ratio, drift)")
    return parser


def add_run_args(parser):
    """Add the run flags: --seed, --json-out, --quiet, --max-steps, --time-budget, --eval-every,
    --tensorboard."""
    g = parser.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json-out", default=None, help="rank 0 writes its results here")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many optimizer steps in total (0: no limit)")
    g.add_argument("--time-budget", type=float, default=0.0,
                   help="stop once the training wall clock passes this many seconds (0: no limit)")
    g.add_argument("--eval-every", type=int, default=0,
                   help="evaluate every N optimizer steps (0: at each epoch's end)")
    g.add_argument("--tensorboard", default=None, help="rank 0 writes TensorBoard events to this folder")
    return parser


def check_compression_args(parser, args):
    """Exit with a usage error when a flag is given to a --compression that does not take it (a flag only
    hvd_topk.DistributedOptimizer has, or low rank's); fill in --powersgd-rank's default for low rank."""
    if not args.compression.startswith("hvd_topk") and (
            args.adaptive_ratio or args.communication == "auto" or args.compress != "gradient"
            or args.local_momentum != "on" or args.second_moment != "local" or args.value_dtype != "float32"):
        parser.error("--adaptive-ratio, --communication auto, --compress update, --local-momentum off, "
                     "--second-moment frozen and --value-dtype float16 need --compression hvd_topk or "
                     "hvd_topk_powersgd")
    if args.dense_steps and args.compression not in ("hvd_topk", "hvd_topk_powersgd", "powersgd"):
        parser.error("--dense-steps needs --compression hvd_topk, hvd_topk_powersgd or powersgd")
    if args.powersgd_rank is not None and not args.compression.endswith("powersgd"):
        parser.error("--powersgd-rank needs --compression powersgd or hvd_topk_powersgd")
    if args.compression.endswith("powersgd") and args.powersgd_rank is None:
        args.powersgd_rank = 4


def distributed_optimizer(args, model, base):
    """``base`` made distributed as --compression says: (optimizer, comp), where comp is the TopKEF or
    PowerSGD given to stock Horovod (it holds this rank's residuals: save its state_dict() with the rank's
    checkpoint), else None (hvd_topk's optimizer keeps its residuals in its own state_dict()).

    Example (``args`` from this file's parser)::

        opt, comp = distributed_optimizer(args, model, torch.optim.SGD(model.parameters(), lr=0.05))
    """
    named = list(model.named_parameters())
    if args.compression.startswith("hvd_topk"):
        return hvd_topk.DistributedOptimizer(base, named_parameters=named, compression=_compressor(args),
                                             **hvd_topk_options(args)), None
    stock = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
    comp = None if args.compression in stock else _compressor(args, named)
    opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=stock.get(args.compression, comp),
                                   groups=args.groups or None)
    return opt, comp


def _compressor(args, named=None):
    """TopKEF or PowerSGD from the flags; ``named``: the stock door's named_parameters (there the
    compressor also takes --communication and --dense-steps, which the optimizer door takes itself)."""
    in_stock_horovod = {} if named is None else dict(named_parameters=named)
    if args.communication is not None and named is not None:
        in_stock_horovod["communication"] = args.communication
    if args.compression in ("powersgd", "hvd_topk_powersgd"):
        dense_steps = {} if named is None else dict(dense_steps=args.dense_steps)
        return hvd_topk.PowerSGD(rank=args.powersgd_rank, **in_stock_horovod, **dense_steps)
    return hvd_topk.TopKEF(ratio=args.ratio, min_numel=args.min_numel, budget=args.budget, **in_stock_horovod)


def hvd_topk_options(args):
    """hvd_topk.DistributedOptimizer's keyword arguments from the flags of ``add_compression_args``,
    all but ``named_parameters`` and ``compression``: ``communication``, ``groups`` and the
    ``settings`` (``hvd_topk.OptimizerSettings``); on rank 0, turns on the log of automatic decisions
    (--adaptive-ratio, --communication auto).

    Example (``args`` from this file's parser)::

        opt = hvd_topk.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                            compression=TopKEF(ratio=args.ratio), **hvd_topk_options(args))
    """
    if hvd.rank() == 0 and (args.adaptive_ratio or args.communication == "auto"):
        logging.basicConfig(format="%(message)s")
        logging.getLogger("hvd_topk").setLevel(logging.INFO)     # rank 0 logs each auto decision
    settings = hvd_topk.OptimizerSettings(
        leader=args.leader, warmup_epochs=args.warmup_epochs, dense_steps=args.dense_steps, selection=args.selection,
        momentum_correction=args.momentum_correction == "on", adaptive_ratio=True if args.adaptive_ratio else None,
        adaptive_weight=args.adaptive_weight, auto_every=args.auto_every, compress=args.compress,
        local_momentum=args.local_momentum == "on", second_moment=args.second_moment,
        value_dtype=torch.float16 if args.value_dtype == "float16" else None)
    return dict(communication=args.communication, groups=args.groups or None, settings=settings)


def loopback_tx_bytes():
    """Bytes sent on the loopback so far, by every process of this network namespace: the kernel's
    counter in /proc/net/dev (the benchmarks read the same counter with testbed/wire.py)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
    raise RuntimeError("no loopback interface 'lo' in /proc/net/dev")


class RunLog:
    """Bookkeeping of one training run: step times, link bytes, the test curve, the stop rule, the JSON.

    Every rank constructs it and calls every method (``should_stop`` and ``finish`` run collectives);
    only rank 0 keeps the records and writes. Per optimizer step it records the step's wall time
    (``begin_step`` to ``end_step``: put them around zero_grad/forward/backward/step) and the bytes
    sent on the loopback since the previous step boundary (so traffic finishing between steps, such
    as the asynchronous allgather of the next step's index sets, is counted; the lists sum to the whole
    training traffic).
    Time inside ``paused()`` (evaluation, checkpoints) is left out of the training wall clock.

    Args:
        args: parsed flags of ``add_compression_args`` and ``add_run_args`` (``args.optimizer`` is
            reported when present).
        example: ``"digits_cnn"`` or ``"char_lm"``.
        model: the model (for ``num_params`` and ``tensors``).
        model_name: the model's name in the JSON, e.g. ``"cnn"``.
        dataset: the dataset's name in the JSON, e.g. ``"digits"``.
        non_iid: whether the ranks' data is skewed.
        start_step: optimizer steps already done (when resuming from a checkpoint).

    Example:
        >>> log = RunLog(args, example="char_lm", model=model, model_name="gpt", dataset="shakespeare")
    """

    def __init__(self, args, example, model, model_name, dataset, non_iid=False, start_step=0):
        self.args = args
        self.rank, self.size = hvd.rank(), hvd.size()
        self.step = start_step            # optimizer steps done in total, identical on all ranks
        # what the JSON reports about the run
        self.meta = {
            "example": example, "compression": args.compression,
            "optimizer": getattr(args, "optimizer", None),
            "ratio": args.ratio if args.compression in ("topkef", "hvd_topk") else None,
            "powersgd_rank": args.powersgd_rank if args.compression.endswith("powersgd") else None,
            "communication": _communication(args),
            "compress": args.compress if args.compression.startswith("hvd_topk") else None,
            "local_momentum": args.local_momentum if args.compression.startswith("hvd_topk") else None,
            "second_moment": args.second_moment if args.compression.startswith("hvd_topk") else None,
            "value_dtype": args.value_dtype if args.compression.startswith("hvd_topk") else None,
            "groups": args.groups or None,
            "ranks": self.size,
            "model": model_name, "dataset": dataset, "non_iid": bool(non_iid),
            "num_params": sum(p.numel() for p in model.parameters()),
            "tensors": [[name, p.numel(), p.dim()] for name, p in model.named_parameters()],
            "min_numel": args.min_numel}
        # per-step records (rank 0)
        self.step_times, self.link_tx, self.curve = [], [], []
        self.last_stats = None
        self.auto_state = None         # hvd_topk: plan, ratio and decision history (auto/adaptive)
        # clocks and counters
        self.t0 = self.tx0 = self.tx_prev = self.t_step = None
        self.paused_s = 0.0
        self.writer = None
        if self.rank == 0 and args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter   # only when asked: it is slow to import
            self.writer = SummaryWriter(args.tensorboard)

    def start(self):
        """Barrier, then start the training clock and the link counters."""
        hvd.allreduce(torch.zeros(1), name="runlog.start")
        self.t0 = time.perf_counter()
        self.tx0 = self.tx_prev = loopback_tx_bytes()

    def wall(self):
        """Training wall clock so far: seconds since ``start()`` less the time spent ``paused()``."""
        return time.perf_counter() - self.t0 - self.paused_s

    @contextlib.contextmanager
    def paused(self):
        """Leave the enclosed time (evaluation, checkpoints) out of the training wall clock."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - t

    def begin_step(self):
        """Mark the start of an optimizer step (just before zero_grad/forward)."""
        self.t_step = time.perf_counter()

    def end_step(self, opt=None, loss=None):
        """Mark the end of an optimizer step (after ``opt.step()`` returned): record its time and bytes.

        Args:
            opt: the optimizer; its ``stats()`` (hvd_topk) are kept and written to TensorBoard.
            loss: the step's training loss (tensor or number) for TensorBoard, or None.
        """
        t = time.perf_counter()
        tx = loopback_tx_bytes()
        self.step += 1
        if self.rank != 0:
            return
        self.step_times.append(t - self.t_step)
        self.link_tx.append(tx - self.tx_prev)
        self.tx_prev = tx
        stats = opt.stats() if opt is not None and hasattr(opt, "stats") else None
        if stats is not None:
            self.last_stats = stats
            self.auto_state = opt.auto_state()
        if self.writer is not None:
            self.writer.add_scalar("train/step_s", self.step_times[-1], self.step)
            self.writer.add_scalar("train/link_tx_bytes", self.link_tx[-1], self.step)
            if loss is not None:
                self.writer.add_scalar("train/loss", float(loss), self.step)
            if stats is not None:   # numbers only: a decision such as a chosen transport is a string
                numbers = {k: v for k, v in stats.items() if isinstance(v, (bool, int, float))}
                hvd_topk.step.stats.write_tensorboard(self.writer, numbers, self.step)

    def eval_due(self, epoch_end=False):
        """True when ``--eval-every`` says to evaluate now (every N steps; 0: at each epoch's end)."""
        every = self.args.eval_every
        return self.step % every == 0 if every > 0 else epoch_end

    def eval_point(self, step, epoch, test_loss, test_acc=None):
        """Append a point to the test curve, stamped with the training wall clock so far."""
        if self.rank != 0:
            return
        self.curve.append({"step": step, "epoch": epoch, "wall_s": self.wall(),
                           "test_loss": float(test_loss),
                           "test_acc": None if test_acc is None else float(test_acc)})
        if self.writer is not None:
            self.writer.add_scalar("test/loss", float(test_loss), step)
            if test_acc is not None:
                self.writer.add_scalar("test/accuracy", float(test_acc), step)

    def should_stop(self, step):
        """True on every rank once ``step`` (steps done) reaches --max-steps or the training wall clock
        passes --time-budget. Rank 0 decides the time budget and broadcasts it (one tiny broadcast per
        call, only when --time-budget is set), so all ranks stop at the same step."""
        if self.args.max_steps > 0 and step >= self.args.max_steps:
            return True
        if self.args.time_budget > 0:
            over = torch.tensor([float(self.rank == 0 and self.wall() >= self.args.time_budget)])
            return hvd.broadcast(over, root_rank=0, name="runlog.stop").item() > 0
        return False

    def finish(self, model, result):
        """End the run: barrier, read the counters, check parameters are bit-identical on every rank,
        merge ``result`` (e.g. test_loss, test_accuracy) into the record; rank 0 writes it to --json-out
        and prints one summary line: the record's single values as JSON, without the per-step lists,
        the curve and the stats (thousands of numbers). Returns the record (on every rank; the lists
        only on rank 0)."""
        hvd.allreduce(torch.zeros(1), name="runlog.end")
        wall, tx = self.wall(), loopback_tx_bytes()
        if self.writer is not None:
            self.writer.close()
        # Parameters must be identical on every rank: compare against rank 0's.
        flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
        same = bool(torch.equal(hvd.broadcast(flat, root_rank=0, name="runlog.params"), flat))
        same = hvd.allreduce(torch.tensor([float(same)]), op=hvd.Min, name="runlog.same").item() == 1.0
        steps = len(self.step_times)
        record = {**self.meta, "steps": steps, "step_times_s": self.step_times,
                  "link_tx_bytes": self.link_tx, "curve": self.curve,
                  "test_loss": None, "test_accuracy": None, "wall_s": wall, "params_identical": same,
                  "loopback_tx_bytes": tx - self.tx0,
                  "bytes_per_rank_per_step": (tx - self.tx0) / self.size / max(1, steps),
                  "hvd_topk_stats": _jsonable(self.last_stats) if self.args.compression.startswith("hvd_topk")
                  else None, "hvd_topk_auto": _jsonable(self.auto_state)}
        record.update(result)
        if self.rank == 0:
            summary = {k: v for k, v in record.items() if not isinstance(v, (list, dict)) or k == "resumed_from"}
            print(json.dumps(summary), flush=True)
            if self.args.json_out:
                with open(self.args.json_out, "w") as f:
                    json.dump(record, f)
        return record


def _communication(args):
    """The transport in use: the flag, else the compressor's default (dense for stock Horovod's own)."""
    if args.compression in ("none", "fp16"):
        return "dense"
    return args.communication or ("lowrank" if args.compression.endswith("powersgd") else "split_reduce")


def _jsonable(stats):
    """A stats() dict with tensors and numpy numbers turned into plain Python values."""
    if stats is None:
        return None
    if isinstance(stats, dict):
        return {str(k): _jsonable(v) for k, v in stats.items()}
    if isinstance(stats, (list, tuple)):
        return [_jsonable(v) for v in stats]
    if isinstance(stats, torch.Tensor):
        return stats.tolist()
    if hasattr(stats, "item"):
        return stats.item()
    return stats
