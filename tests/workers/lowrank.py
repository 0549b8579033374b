"""The low-rank (PowerSGD) transport driven through the ``Transport`` protocol (tests/test_lowrank.py).

Scenarios, each a fresh ``LowRank`` (rank ``--rank``) over keys of several shapes (a conv weight, a
linear weight, a bias, a matrix too thin to shrink twofold):

- ``main``: averaging, float64, ``--steps`` steps; rank 1 poisons "fc" and "bias" with a NaN at
  ``--nan-step``.
- ``resume``: ``main``'s data; after step ``--save-at`` the state (Q's, through torch.save) and this
  rank's residuals go to a new ``LowRank``, which runs the remaining steps.
- ``sum``: summing instead of averaging, 2 steps.
- ``mixed``: the conv weight in float32, the rest float64 (one allreduce per dtype and phase), 2 steps.
- ``wire16`` and ``wire32``: every key in float32, ``--steps`` steps, with ``values='fp16'`` and
  ``'fp32'`` (the default), on the same data; at ``--jump-step`` every rank's "fc" gradient is 1e6 times
  larger (its float16 sums overflow: sent again in float32).
- ``set`` (with ``--set``, registered at ``hvd.init``): 2 steps within that process set; the ranks
  outside it run nothing.
- ``hosts`` and ``flat`` (with ``--hosts L``: the ranks as hosts of L, their host and cross sets
  registered at ``hvd.init``): ``main``'s steps and NaN with the sums taken through the hosts, and the
  same data with the flat transport beside it; ``wire16_hosts``: ``wire16``'s data, steps and jump
  through the hosts.

Every rank starts the keys in its own order (rotated by its rank, reversed on odd ranks) and finishes
them in yet another, so a transport that ran collectives in start or finish order would hang. Writes
``<out>/rank<r>.pt``: per scenario, per step and key, the gradient, the accumulator, the aggregate,
the residual the outcome gave (None: flushed), nbytes, the Q before and after the step; per step the
allreduces; and this rank's orders.
"""
import argparse
import io
import os

import horovod.torch as hvd
import torch

from hvd_topk.transports.collectives import Collectives
from hvd_topk.transports.host_sets import HostSets, host_process_sets
from hvd_topk.transports.lowrank import LowRank

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--nan-step", type=int, default=3)
p.add_argument("--save-at", type=int, default=1)
p.add_argument("--jump-step", type=int, default=3)
p.add_argument("--set", default="", help="comma-separated ranks of a process set for the 'set' scenario")
p.add_argument("--hosts", type=int, default=0, help="ranks per emulated host, for the 'hosts' scenario")
args = p.parse_args()

pair = hvd.ProcessSet([int(r) for r in args.set.split(",")]) if args.set else None
# the host sets, then the cross sets, from the launcher's size (horovodrun's or mpirun's)
host_sets = host_process_sets(local_size=args.hosts) if args.hosts else []
n_hosts = len(host_sets) - args.hosts
hvd.init(process_sets=([pair] if pair else []) + host_sets or None)
torch.set_num_threads(1)
SHAPES = {"conv": (6, 3, 3, 3), "fc": (20, 12), "bias": (20,), "thin": (3, 40)}
KEYS = sorted(SHAPES)
DATA = {"main": 0, "resume": 0, "sum": 1, "mixed": 2, "set": 3, "hosts": 0, "flat": 0, "wire16": 4, "wire32": 4,
        "wire16_hosts": 4}
VALUES = {"wire16": "fp16", "wire16_hosts": "fp16"}                           # the others 'fp32', the default


def build(scenario, average, process_set, hosts=None):
    collectives = Collectives(f"lowrank.{scenario}.group", process_set=process_set)
    return LowRank(collectives, average, rank=args.rank, shapes=SHAPES, name=f"lowrank.{scenario}", seed=7,
                   hosts=hosts, values=VALUES.get(scenario, "fp32"))


def emulated_hosts():
    """This rank's ``HostSets`` of the registered host and cross sets."""
    h = hvd.rank() // args.hosts
    return HostSets(host=host_sets[h], cross=host_sets[n_hosts + hvd.rank() % args.hosts],
                    position=hvd.rank() % args.hosts, hosts=n_hosts, per_host=args.hosts)


def orders(step):
    """(start order, finish order) of this rank at ``step``: different on every rank."""
    rotated = KEYS[hvd.rank() % len(KEYS):] + KEYS[:hvd.rank() % len(KEYS)]
    starts = list(reversed(rotated)) if hvd.rank() % 2 else rotated
    return starts, starts[step % len(KEYS):] + starts[:step % len(KEYS)]


def gradient(scenario, key, step, dtype):
    gen = torch.Generator().manual_seed(100000 * DATA[scenario] + 1000 * hvd.rank() + 10 * step + KEYS.index(key))
    jump = 1e6 if scenario.startswith("wire") and step == args.jump_step and key == "fc" else 1.0
    return (torch.randn(SHAPES[key], generator=gen, dtype=torch.float64) * jump).to(dtype)


def one_step(transport, scenario, step, residual, dtypes):
    """Start every key, finish every key; returns the step's records; updates ``residual``."""
    starts, finishes = orders(step)
    started, records = {}, {}
    for key in starts:
        g = gradient(scenario, key, step, dtypes[key])
        acc = g.reshape(-1) + residual[key]
        if scenario in ("main", "resume", "hosts", "flat") and step == args.nan_step and hvd.rank() == 1 \
                and key in ("fc", "bias"):
            acc[3] = float("nan")
        q_before = transport.state_dict()["q"].get(key)
        started[key] = (transport.start(key, acc, None, bool(torch.isfinite(acc).all())), acc, g, q_before)
    for key in finishes:
        st, acc, g, q_before = started[key]
        out = st.finish()
        assert out.sent is None, "the low-rank transport sends no entry whole"
        if out.aggregate is not None:               # committed only if every rank was finite
            residual[key] = torch.zeros_like(acc) if out.residual is None else out.residual.clone()
        records[key] = dict(step=step, key=key, grad=g.reshape(-1).clone(), acc=acc.clone(), aggregate=out.aggregate,
                            residual=out.residual, kept=residual[key].clone(), nbytes=st.nbytes, sent_sq=st.sent_sq,
                            q_before=q_before, q_after=transport.state_dict()["q"].get(key))
    return [records[key] for key in KEYS], list(transport.launches)


def run(scenario, average=True, steps=2, save_at=None, process_set=hvd.global_process_set, dtypes=None, hosts=None):
    dtypes = dtypes or {key: torch.float64 for key in KEYS}
    transport = build(scenario, average, process_set, hosts)
    residual = {key: torch.zeros(SHAPES[key], dtype=dtypes[key]).reshape(-1) for key in KEYS}
    records, launches = [], []
    for step in range(steps):
        recs, launched = one_step(transport, scenario, step, residual, dtypes)
        records += recs
        launches.append(launched)
        if step == save_at:                        # as a checkpoint would: through bytes, to a new one
            buf = io.BytesIO()
            torch.save({"transport": transport.state_dict(), "residual": residual}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=False)
            transport = build(scenario, average, process_set, hosts)
            transport.load_state_dict(saved["transport"])
            residual = saved["residual"]
    return dict(records=records, launches=launches, ranks=process_set.ranks or list(range(hvd.size())))


result = {"size": hvd.size(), "orders": [orders(step) for step in range(args.steps)],
          "main": run("main", steps=args.steps),
          "resume": run("resume", steps=args.steps, save_at=args.save_at),
          "sum": run("sum", average=False),
          "mixed": run("mixed", dtypes={key: torch.float32 if key == "conv" else torch.float64 for key in KEYS}),
          "wire16": run("wire16", steps=args.steps, dtypes=dict.fromkeys(KEYS, torch.float32)),
          "wire32": run("wire32", steps=args.steps, dtypes=dict.fromkeys(KEYS, torch.float32))}
if args.hosts:
    result["hosts"] = run("hosts", steps=args.steps, hosts=emulated_hosts())
    result["flat"] = run("flat", steps=args.steps)
    result["wire16_hosts"] = run("wire16_hosts", steps=args.steps, dtypes=dict.fromkeys(KEYS, torch.float32),
                                 hosts=emulated_hosts())
if pair is not None:
    result["set"] = run("set", process_set=pair) if pair.included() else None
    hvd.barrier()          # a rank that left early would shut Horovod down under the set's ranks
torch.save(result, os.path.join(args.out, f"rank{hvd.rank()}.pt"))
