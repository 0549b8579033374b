"""communication='hierarchical' against the flat transports and dense Horovod, across 2 emulated hosts.

2 hosts x 2 ranks (``testbed/hosts.py``: network namespaces joined by a bridge, each host's eth0
limited by tbf to the link's rate), horovodrun with Gloo, ``HOROVOD_CYCLE_TIME=20``. Every mode trains
its own copy of the wide digits CNN (6.33M parameters, same seed; ``--example lm``: the byte-level GPT
of examples/char_lm.py, as bench/ddp_hooks.py trains both for DDP's rows) in one job; after a warm-up of each
mode alone, the modes take turns of one step, the order rotating every round, so a slow spell of the
machine falls on all of them alike (as ``bench.sidebyside``).

Step time: rank 0's wall time from ``zero_grad()`` to the end of ``step()``, median over the rounds.
Test accuracy (digits) or loss (LM): rank 0's, after the last step of each mode.
Inter-host bytes: after the rounds every mode runs ``--bytes-steps`` steps alone, between two
barriers; each host's first rank reads its host's eth0 tx counter at both barriers, and the two
hosts' deltas summed, over the steps, are every byte that crossed between the hosts per step
(gradients, Horovod's negotiation, the launcher's ssh). (The per-step deltas read during the rounds,
where a transfer that outlives its step lands in the next mode's window, are kept too: ``rounds_bytes``.)

``--launcher mpi``: mpirun instead, with Open MPI's shared-memory transport (vader) between the ranks
of a host and TCP on eth0 between the hosts (``testbed/launch.py``, ``shared_memory``): Horovod's
CPU collectives then go through MPI, and hierarchical's dense reduce-scatter inside a host through
memory, as on a real host, instead of Gloo's TCP over the loopback.

Horovod reads ``HOROVOD_HIERARCHICAL_ALLREDUCE`` once, at ``hvd.init``, for the whole job, so its dense
mode runs in a second job per link, with ``hvd_topk hierarchical`` beside it again: the two are compared
within that job.

    python -m bench.hierarchical --bandwidths 100mbit,1gbit --rounds 15 --out bench/results/hierarchical_r0.01
    python -m bench.hierarchical --launcher mpi --bandwidths 100mbit --out bench/results/hierarchical_r0.01_mpi
"""
import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

from bench.constants import AUTO_MODE as AUTO
from bench.constants import BANDWIDTHS, CYCLE_TIME_MS, RESULTS, ROOT
from bench.sidebyside import auto_busy

MODES = ("dense", "hvd_topk split_reduce", "hvd_topk hierarchical", "topkef", "topkef hierarchical")
# on request: Horovod's fp16 compression; auto (which may choose hierarchical: the job registers the
# host sets), warmed up until its probe and trial are over (at most --max-warmup steps); and hvd_topk's
# dense transport (auto's dense plan) beside Horovod's own dense
EXTRA_MODES = ("fp16", AUTO, "hvd_topk dense")
HHA = "dense, HOROVOD_HIERARCHICAL_ALLREDUCE=1"
SLOTS = 2
# the targets (inter-host bytes and step time, as fractions of the mode named)
TARGETS = (("bytes", "hvd_topk split_reduce", 0.6, None), ("median_ms", "hvd_topk split_reduce", 0.8, "100mbit"),
           ("median_ms", HHA, 0.2, "100mbit"))


def _eth0_tx():
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def worker(a):
    import horovod.torch as hvd
    import torch

    import hvd_topk
    from bench.ddp_hooks import digits_task, lm_task
    from hvd_topk import TopKEF

    hvd.init(process_sets=hvd_topk.host_process_sets())
    torch.set_num_threads(1)
    task = digits_task(hvd.rank(), hvd.size(), a.batch_size) if a.example == "digits" else \
        lm_task(hvd.rank(), hvd.size(), a.batch_size, a.max_warmup + a.rounds + a.bytes_steps)
    arms = []
    for i, mode in enumerate(a.modes):
        torch.manual_seed(0)
        model = task.build()
        base = task.make_opt(model)
        named = [(f"m{i}.{n}", p) for n, p in model.named_parameters()]    # Horovod's names, per mode
        if mode.startswith("hvd_topk "):
            opt = hvd_topk.DistributedOptimizer(base, named_parameters=named, compression=TopKEF(ratio=a.ratio),
                                                communication=mode.split()[1])
        else:
            communication = mode.split()[1] if " " in mode else "split_reduce"
            compression = (TopKEF(ratio=a.ratio, named_parameters=named, communication=communication)
                           if mode.startswith("topkef") else hvd.Compression.fp16 if mode == "fp16"
                           else hvd.Compression.none)
            opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        arms.append((mode, model, opt))
    first_on_host = hvd.local_rank() == 0

    def step(model, opt, t):
        x, target = task.batch(t)
        for group in opt.param_groups if task.lr_at else ():
            group["lr"] = task.lr_at(t)
        t0, tx0 = time.perf_counter(), _eth0_tx() if first_on_host else 0
        opt.zero_grad()
        task.loss(model(x), target).backward()
        if task.clip:                          # the averaged gradient, as Horovod's docs clip it
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), task.clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        return time.perf_counter() - t0, (_eth0_tx() - tx0) if first_on_host else 0

    record = {mode: {"step_s": [], "tx": []} for mode in a.modes}
    steps = {mode: 0 for mode in a.modes}
    for mode, model, opt in arms:                       # warm-up: each mode alone, in turn
        while steps[mode] < a.warmup or (mode == AUTO and auto_busy(opt.auto_state())):
            if steps[mode] >= a.max_warmup:
                raise RuntimeError(f"{mode}: still probing or in its trial after {steps[mode]} steps (--max-warmup)")
            step(model, opt, steps[mode])
            steps[mode] += 1
    for r in range(a.rounds):
        for j in range(len(arms)):
            mode, model, opt = arms[(r + j) % len(arms)]
            s, tx = step(model, opt, steps[mode])
            steps[mode] += 1
            record[mode]["step_s"].append(s)
            record[mode]["tx"].append(tx)
    for mode, model, opt in arms:                       # bytes: each mode alone, between barriers
        hvd.allreduce(torch.zeros(1), name=f"bench.{mode}.before")
        tx0 = _eth0_tx() if first_on_host else 0
        for _ in range(a.bytes_steps):
            step(model, opt, steps[mode])
            steps[mode] += 1
        hvd.allreduce(torch.zeros(1), name=f"bench.{mode}.after")
        record[mode]["alone_tx"] = (_eth0_tx() - tx0) if first_on_host else 0
    for mode, model, _ in arms:                         # parameters are identical on every rank: rank 0's
        record[mode].update(task.metrics(model) if hvd.rank() == 0 else {}, steps=steps[mode])
    everyone = hvd.allgather_object((hvd.local_rank(), record), name="bench.records")
    if hvd.rank() == 0:
        hosts_first = [r for r, (local_rank, _) in enumerate(everyone) if local_rank == 0]
        out = {"ranks": hvd.size(), "ratio": a.ratio, "rounds": a.rounds, "bytes_steps": a.bytes_steps,
               "example": task.name, "model": task.model, "modes": {}}
        for mode in a.modes:
            per_step = [sum(everyone[r][1][mode]["tx"][t] for r in hosts_first) for t in range(a.rounds)]
            alone = sum(everyone[r][1][mode]["alone_tx"] for r in hosts_first) / a.bytes_steps
            out["modes"][mode] = {"step_s": record[mode]["step_s"], "inter_host_bytes": alone,
                                  "rounds_inter_host_bytes": per_step, "steps": record[mode]["steps"],
                                  "test_loss": record[mode]["test_loss"], "test_accuracy": record[mode]["test_accuracy"]}
        out["auto"] = {mode: opt.auto_state() for mode, _, opt in arms if mode == AUTO}     # its decisions
        with open(a.json_out, "w") as f:
            json.dump(out, f)


def summarise(record):
    rows = {}
    for mode, m in record["modes"].items():
        q = statistics.quantiles(m["step_s"], n=4)
        rows[mode] = {"median_ms": 1e3 * statistics.median(m["step_s"]), "q1_ms": 1e3 * q[0], "q3_ms": 1e3 * q[2],
                      "bytes": m["inter_host_bytes"], "rounds_bytes": statistics.fmean(m["rounds_inter_host_bytes"]),
                      "steps": m.get("steps"), "test_loss": m.get("test_loss"), "test_accuracy": m.get("test_accuracy")}
    return rows


def targets(rows_by_link):
    """(what, link, hierarchical's figure / the other's, limit, met) of each target that has its data."""
    out = []
    for link, rows in rows_by_link.items():
        for key, other, limit, only in TARGETS:
            if (only is None or only == link) and other in rows and "hvd_topk hierarchical" in rows:
                mine = rows["hvd_topk hierarchical" if other != HHA else "hvd_topk hierarchical (HHA job)"]
                ratio = mine[key] / rows[other][key]
                out.append((f"{'inter-host bytes' if key == 'bytes' else 'step time'} vs {other}", link, ratio,
                            limit, ratio <= limit))
    return out


LAUNCHERS = {"gloo": "horovodrun, Gloo",
             "mpi": "mpirun, Open MPI: shared memory (vader) inside a host, TCP on eth0 between the hosts"}


EXAMPLES = {"digits": "Wide digits CNN (6.33M parameters, SGD)",
            "lm": "Byte-level GPT 4x128 of examples/char_lm.py (0.84M parameters, AdamW, clipped to norm 1)"}


def _metric(r):
    """The test figure of a row: accuracy (digits) or loss (LM), after the row's steps."""
    if r.get("test_accuracy") is not None:
        return f"{r['test_accuracy']:.4f}"
    return "-" if r.get("test_loss") is None else f"loss {r['test_loss']:.3f}"


def report(rows_by_link, command, launcher="gloo", example="digits"):
    L = ["# communication='hierarchical' across 2 emulated hosts x 2 ranks, side by side", "",
         f"{EXAMPLES[example]}, ratio as given, 2 hosts x 2 ranks ({LAUNCHERS[launcher]}), each "
         "host's eth0 limited by tbf. Step: rank 0, zero_grad to the end of step, median and quartiles over "
         "the rounds; inter-host bytes per step: both hosts' eth0 tx over steps of the mode alone (in the "
         "rounds: the mean of the per-step deltas, approximate; see `bench/hierarchical.py`). Rows marked (HHA job) ran in the second job of the link, with "
         "HOROVOD_HIERARCHICAL_ALLREDUCE=1. Test: rank 0's test accuracy (digits) or loss (LM) after the "
         "mode's steps, all short: the modes' quality side by side, not a final one.", "", f"Command: `{command}`", "",
         "Plot: [hierarchical.png](hierarchical.png)", ""]
    for link, rows in rows_by_link.items():
        L += [f"## {link}", "", "| mode | median step (ms) | quartiles | inter-host bytes/step | in the rounds | "
              "steps | test |", "|---|---:|---|---:|---:|---:|---:|"]
        for mode, r in rows.items():
            L.append(f"| {mode} | {r['median_ms']:,.1f} | {r['q1_ms']:,.1f}-{r['q3_ms']:,.1f} | {r['bytes']:,.0f} | "
                     f"{r['rounds_bytes']:,.0f} | {r.get('steps') or '-'} | {_metric(r)} |")
        L.append("")
        L += [f"{AUTO}'s decisions: " + "; ".join(f"step {h[0]}: {h[3]}" for h in rows[AUTO]["auto_history"]), ""] \
            if AUTO in rows and rows[AUTO].get("auto_history") else []
    L += ["## Targets", "", "| hvd_topk hierarchical | link | ratio | limit | |", "|---|---|---:|---:|---|"]
    for what, link, ratio, limit, met in targets(rows_by_link):
        L.append(f"| {what} | {link} | {ratio:.3f}x | {limit}x | **{'met' if met else 'not met'}** |")
    return "\n".join(L) + "\n"


def driver(a):
    from testbed.hosts import EmulatedHosts
    from testbed.launch import run_job
    from bench.manifest import write_manifest

    command = "python -m bench.hierarchical " + shlex.join(sys.argv[1:])
    os.makedirs(a.out, exist_ok=True)
    write_manifest(a.out, command)
    rows_by_link = {}
    for link in a.bandwidths:
        hosts = EmulatedHosts(2, BANDWIDTHS[link])
        hosts.up(exclusive=True)     # alone: the measurement needs the link, and nobody may rebuild it meanwhile
        rows = {}
        try:
            jobs = [("modes", a.modes, {})]
            if not a.no_hha:
                jobs.append(("hha", ["dense", "hvd_topk hierarchical"], {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}))
            for job, modes, env in jobs:
                with tempfile.TemporaryDirectory() as tmp:
                    js = os.path.join(tmp, "r.json")
                    argv = [sys.executable, "-m", "bench.hierarchical", "--worker", "--json-out", js, "--modes",
                            ",".join(modes), "--ratio", str(a.ratio), "--rounds", str(a.rounds), "--warmup",
                            str(a.warmup), "--max-warmup", str(a.max_warmup), "--batch-size", str(a.batch_size),
                            "--example", a.example,
                            "--bytes-steps", str(a.bytes_steps)]
                    t0 = time.perf_counter()
                    try:
                        run_job(2 * SLOTS, argv, backend=a.launcher, timeout=a.timeout, prefix=hosts.hosts[0].prefix,
                                cwd=ROOT, hosts=hosts.host_list(SLOTS), interface="eth0",
                                env={"HOROVOD_CYCLE_TIME": CYCLE_TIME_MS, **env},
                                shared_memory=a.launcher == "mpi")
                    finally:
                        hosts.kill_strays()
                    with open(js) as f:
                        record = json.load(f)
                record["command"], record["env"], record["launcher"] = command, env, a.launcher
                with open(os.path.join(a.out, f"{link}-{job}.json"), "w") as f:
                    json.dump(record, f)
                summary = summarise(record)
                if AUTO in summary:
                    summary[AUTO]["auto_history"] = record.get("auto", {}).get(AUTO, {}).get("history")
                if job == "hha":
                    summary = {HHA: summary["dense"], "hvd_topk hierarchical (HHA job)": summary["hvd_topk hierarchical"]}
                rows.update(summary)
                print(f"{link} {job}: {time.perf_counter() - t0:.0f} s; " + ", ".join(
                    f"{m} {r['median_ms']:.0f} ms {r['bytes']:,.0f} B" for m, r in summary.items()), flush=True)
        finally:
            hosts.close()
        rows_by_link[link] = rows
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({"launcher": a.launcher, "example": a.example, "links": rows_by_link, "targets": targets(rows_by_link)}, f, indent=1)
    text = report(rows_by_link, command, a.launcher, a.example)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    from bench.plot_hierarchical import plot
    print(plot(a.out, f"{os.path.basename(os.path.normpath(a.out))} ({LAUNCHERS[a.launcher].split(',')[0]})"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bandwidths", default="100mbit,1gbit", help=f"comma-separated, of {list(BANDWIDTHS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES + EXTRA_MODES)}")
    p.add_argument("--example", choices=sorted(EXAMPLES), default="digits",
                   help="digits: the wide CNN; lm: char_lm's GPT (bench/ddp_hooks.py's tasks, as DDP's rows train them)")
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=15, help="turns of every mode after the warm-up")
    p.add_argument("--warmup", type=int, default=3, help="steps of every mode alone before the rounds")
    p.add_argument("--max-warmup", type=int, default=400, help="hvd_topk auto: steps allowed for its probe and trial")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--bytes-steps", type=int, default=5, help="steps of every mode alone, for its bytes")
    p.add_argument("--launcher", choices=sorted(LAUNCHERS), default="gloo",
                   help="gloo: horovodrun --gloo; mpi: mpirun, shared memory inside a host")
    p.add_argument("--no-hha", action="store_true", help="skip the HOROVOD_HIERARCHICAL_ALLREDUCE=1 job")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per job")
    p.add_argument("--out", default=os.path.join(RESULTS, "hierarchical"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.bandwidths = [b for b in a.bandwidths.split(",") if b]
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [b for b in a.bandwidths if b not in BANDWIDTHS] + [m for m in a.modes if m not in MODES + EXTRA_MODES]
    if bad or not a.modes:
        p.error(f"--bandwidths take {list(BANDWIDTHS)}, --modes {list(MODES + EXTRA_MODES)}; got {bad or a.modes}")
    if a.rounds < 2 or a.warmup < 0 or a.batch_size < 1 or a.bytes_steps < 1:
        p.error("--rounds must be >= 2, --warmup >= 0, --batch-size and --bytes-steps >= 1")
    return a


if __name__ == "__main__":
    args = parse_args()
    worker(args) if args.worker else driver(args)
