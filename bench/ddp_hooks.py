"""PyTorch DDP's communication hooks on Gloo, side by side in one job: the peers of the Horovod rows.

Every mode trains its own copy of the same model (same seed, same batches) with
``torch.nn.parallel.DistributedDataParallel`` over ``torch.distributed`` on Gloo, each with one hook:

- ``ddp``: no hook (DDP's own bucketed allreduce, fp32);
- ``ddp fp16``: ``default_hooks.fp16_compress_hook`` (each bucket cast to fp16, allreduced, cast back);
- ``ddp powersgd rN``: torch's own ``powerSGD_hook`` (layer-wise PowerSGD, error feedback and warm
  start on, ``matrix_approximation_rank`` N, ``start_powerSGD_iter`` 2), unchanged, with the model in
  ONE DDP bucket. On Gloo the hook cannot run with several buckets: its P and Q allreduces are issued
  from a callback on Gloo's worker thread while the autograd thread issues the next bucket's
  allreduce, so the two ranks issue their collectives in different orders and Gloo pairs unequal
  messages ("Received data size doesn't match expected size"). With one bucket per step there is one
  chain of collectives, in the same order on every rank. ``--powersgd-layout`` chooses: ``one-bucket``
  (default), ``serial`` (DDP's own buckets; each bucket's hook future is waited for before the hook
  returns, so the buckets' chains do not overlap), or ``ddp-buckets`` (torch's hook as it is, with DDP's
  own buckets: the failure, for the record). docs/results.md has the analysis and a reproduction.

The models are the benchmarks' own: the wide digits CNN (examples/digits_cnn.py ``build_model``, SGD
lr 0.05 momentum 0.9, batch 16 per rank) and the byte-level GPT of examples/char_lm.py (4 x 128,
block 128, AdamW with its warm-up/cosine schedule, the averaged gradient clipped to norm 1).

Side by side: after each mode's warm-up (``--warmup`` steps alone, PowerSGD's dense steps included),
the modes take turns of ``--turn`` steps, the order rotating every round, for ``--rounds`` rounds. Each
turn starts and ends with a barrier; the bytes of a turn are the interface's tx counter (``--iface``:
``lo`` on one host inside a private network namespace, ``eth0`` on emulated hosts) read by each
host's first rank at the two barriers, summed over the hosts (an allreduce), so a turn's bytes are its
own; the barriers' few hundred bytes are counted with them. Step time: rank 0's wall time from
``zero_grad()`` to the end of ``step()``, median over all recorded steps.

Ranks come from the launcher's environment (horovodrun/mpirun, as testbed/launch.py starts them,
or torchrun); no Horovod collective is used.

    python -m bench.ddp_hooks --example digits --bandwidth 100mbit --rounds 20 \
        --out bench/results/ddp_hooks_digits_100mbit
    python -m bench.ddp_hooks --hosts 2 --bandwidth 100mbit ...    # 2 emulated hosts x --slots ranks
"""
import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import types

from bench.constants import BANDWIDTHS, ROOT, TBF_BURST

MODES = ("ddp", "ddp fp16", "ddp powersgd r2", "ddp powersgd r4")
EXAMPLES = ("digits", "lm")
LAYOUTS = ("one-bucket", "serial", "ddp-buckets")
START_POWERSGD_ITER = 2       # the smallest torch allows with error feedback / warm start


# -- the job ------------------------------------------------------------------------------------------
def launcher_env():
    """(rank, size, local_rank) from horovodrun's, mpirun's or torchrun's environment."""
    for r, s, lr in (("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
                     ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                     ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        if r in os.environ and s in os.environ:
            return int(os.environ[r]), int(os.environ[s]), int(os.environ.get(lr, 0))
    raise RuntimeError("no rank in the environment: launch with horovodrun, mpirun or torchrun")


def init_group(a):
    """torch.distributed on Gloo over ``--iface``; the store at ``--master-addr`` (default: the
    launcher's rendezvous address, i.e. the first host). A collective that does not finish within
    ``--gloo-timeout`` seconds raises on the rank instead of hanging it."""
    import torch.distributed as dist

    rank, size, local_rank = launcher_env()
    os.environ["GLOO_SOCKET_IFNAME"] = a.iface
    addr = a.master_addr or os.environ.get("MASTER_ADDR") or os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR",
                                                                            "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{a.master_port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=a.gloo_timeout))
    return rank, size, local_rank


def iface_tx(iface):
    """tx_bytes of ``iface`` in this process's network namespace."""
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


def _examples():
    path = os.path.join(ROOT, "examples")
    if path not in sys.path:
        sys.path.insert(0, path)


def digits_task(rank, size, batch_size, model="wide"):
    """(build, make_opt, batch, metrics) for the wide digits CNN (or the small one, ``model="cnn"``), as
    bench/sidebyside.py trains it."""
    import torch
    import torch.nn.functional as F

    _examples()
    from data import load_dataset
    from digits_cnn import build_model

    x, y, xt, yt = load_dataset("digits")
    batches = len(y) // size // batch_size

    def batch(t):
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(t // batches))
        mine = perm[rank::size][(t % batches) * batch_size:][:batch_size]
        return x[mine], y[mine]

    def metrics(model):
        model.eval()
        with torch.no_grad():
            out = model(xt)
        model.train()
        return {"test_loss": F.cross_entropy(out, yt).item(),
                "test_accuracy": (out.argmax(1) == yt).float().mean().item()}

    return types.SimpleNamespace(
        name="digits", model=model, dataset="digits", build=lambda: build_model(model, x.shape[1]),
        make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), batch=batch,
        loss=lambda out, target: F.cross_entropy(out, target), metrics=metrics, clip=0.0, lr_at=None)


def lm_task(rank, size, batch_size, total_steps):
    """The same for the byte-level GPT of examples/char_lm.py with its defaults (IID windows)."""
    import torch
    import torch.nn.functional as F

    _examples()
    import char_lm

    data, name = char_lm.load_corpus(None, 128)
    train, val = char_lm.split_train_val(data)
    val_starts = char_lm.eval_starts(len(val), 128, 128)
    sched = argparse.Namespace(lr=2e-3, warmup_iters=min(50, max(1, total_steps // 10)), schedule="cosine",
                               steps=total_steps)

    def batch(t):
        gen = torch.Generator().manual_seed(1_000_003 * t + rank)     # step t's windows, the same in every mode
        return char_lm.get_batch(train, char_lm.window_starts(0, len(train), 128, batch_size, gen), 128)

    def make_opt(m):
        decay = [q for q in m.parameters() if q.dim() >= 2]
        rest = [q for q in m.parameters() if q.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=sched.lr, betas=(0.9, 0.99))

    return types.SimpleNamespace(
        name="lm", model="gpt-4x128", dataset=name, build=lambda: char_lm.GPT(4, 4, 128, 128), make_opt=make_opt,
        batch=batch, loss=lambda out, target: F.cross_entropy(out.flatten(0, 1), target.flatten()),
        metrics=lambda m: {"test_loss": char_lm.evaluate(m, val, val_starts, 128), "test_accuracy": None},
        clip=1.0, lr_at=lambda step: char_lm.lr_at(step, sched))


def wrap(model, mode, a):
    """``model`` in DDP with ``mode``'s hook; returns (ddp, powersgd state or None, bucket_cap_mb)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not mode.startswith("ddp powersgd"):
        ddp = DDP(model)
        if mode == "ddp fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp, None, None
    # One bucket: DDP makes its first bucket as large as bucket_cap_mb when that is given.
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    cap = int(model_mb) + 1 if a.powersgd_layout == "one-bucket" else None
    ddp = DDP(model, bucket_cap_mb=cap)
    state = psgd.PowerSGDState(None, matrix_approximation_rank=int(mode.rsplit("r", 1)[1]),
                               start_powerSGD_iter=START_POWERSGD_ITER)
    hook = psgd.powerSGD_hook
    if a.powersgd_layout == "serial":
        def serial_powerSGD_hook(state, bucket):      # DDP requires the name `bucket`
            fut = psgd.powerSGD_hook(state, bucket)
            fut.wait()       # this bucket's P and Q allreduces are done before the next bucket's hook starts
            return fut
        hook = serial_powerSGD_hook
    ddp.register_comm_hook(state, hook)
    return ddp, state, cap


def params_identical(model):
    """True when ``model``'s parameters are bitwise the same on every rank (torch.distributed, collective)."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    same = torch.tensor([int(torch.equal(flat, ref))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def host_tx(iface, local_rank):
    """``iface``'s tx counter on this host (its first rank reads it), summed over the hosts (collective)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(iface_tx(iface)) if local_rank == 0 else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def worker(a):
    import torch
    import torch.distributed as dist

    rank, size, local_rank = init_group(a)
    torch.set_num_threads(1)
    total = a.warmup + a.rounds * a.turn
    if a.example == "digits":
        task = digits_task(rank, size, a.batch_size, a.model)
    else:
        task = lm_task(rank, size, a.batch_size, total)
    arms = []
    for mode in a.modes:
        torch.manual_seed(0)
        model = task.build()
        ddp, state, cap = wrap(model, mode, a)
        arms.append(types.SimpleNamespace(mode=mode, model=model, ddp=ddp, opt=task.make_opt(ddp), state=state,
                                          cap=cap, steps=0, step_s=[], bytes=[]))

    def step(arm):
        x, target = task.batch(arm.steps)
        if task.lr_at is not None:
            for group in arm.opt.param_groups:
                group["lr"] = task.lr_at(arm.steps)
        t0 = time.perf_counter()
        arm.opt.zero_grad()
        task.loss(arm.ddp(x), target).backward()
        if task.clip:
            torch.nn.utils.clip_grad_norm_(arm.model.parameters(), task.clip)
        arm.opt.step()
        arm.steps += 1
        return time.perf_counter() - t0

    for arm in arms:                              # warm-up: each mode alone (PowerSGD's dense steps)
        for _ in range(a.warmup):
            step(arm)
    for r in range(a.rounds):                     # then --turn steps each, the order rotating
        for j in range(len(arms)):
            arm = arms[(r + j) % len(arms)]
            tx0 = host_tx(a.iface, local_rank)
            arm.step_s += [step(arm) for _ in range(a.turn)]
            arm.bytes.append((host_tx(a.iface, local_rank) - tx0) / a.turn)
    out = {"example": task.name, "model": task.model, "dataset": task.dataset, "ranks": size, "iface": a.iface,
           "warmup": a.warmup, "rounds": a.rounds, "turn": a.turn, "batch_size": a.batch_size,
           "powersgd_layout": a.powersgd_layout, "torch": torch.__version__, "modes": {}}
    for arm in arms:
        out["modes"][arm.mode] = {
            "step_s": arm.step_s, "bytes": arm.bytes, "steps": arm.steps, "bucket_cap_mb": arm.cap,
            "params_identical": params_identical(arm.model), "num_params": sum(p.numel() for p in arm.model.parameters()),
            "powersgd_compression_rate": arm.state.compression_stats()[0] if arm.state else None,
            **task.metrics(arm.model)}
    if rank == 0:
        with open(a.json_out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


# -- rows ---------------------------------------------------------------------------------------------
def rows_of(record, bandwidth, hosts):
    """One row per mode, in the shape of bench/rows.py's steps rows (``link_bytes``: bytes per rank per
    step on the counted interface; ``interhost_bytes``: all hosts' tx on it per step, with hosts)."""
    rows = []
    for mode, m in record["modes"].items():
        q = statistics.quantiles(m["step_s"], n=10, method="inclusive") if len(m["step_s"]) > 1 else m["step_s"] * 9
        per_step = statistics.median(m["bytes"])
        rows.append({"example": record["example"], "ranks": record["ranks"], "hosts": hosts, "bandwidth": bandwidth,
                     "cycle_ms": None, "repeat": 0, "label": mode, "ratio": None, "status": "ok", "error": "",
                     "model": record["model"], "dataset": record["dataset"], "num_params": m["num_params"],
                     "steps": m["steps"], "measured_steps": len(m["step_s"]),
                     "step_s": statistics.median(m["step_s"]), "step_s_p10": q[0], "step_s_p90": q[-1],
                     "link_bytes": per_step / record["ranks"], "interhost_bytes": per_step if hosts else None,
                     "iface": record["iface"], "params_identical": m["params_identical"],
                     "test_loss": m["test_loss"], "test_accuracy": m["test_accuracy"],
                     "bucket_cap_mb": m["bucket_cap_mb"], "powersgd_layout": record["powersgd_layout"]
                     if mode.startswith("ddp powersgd") else None,
                     "powersgd_compression_rate": m["powersgd_compression_rate"], "torch": record["torch"]})
    dense = next((r for r in rows if r["label"] == "ddp"), None)
    for r in rows:
        if dense:
            r["speedup_vs_ddp"] = dense["step_s"] / r["step_s"]
            r["bytes_vs_ddp"] = r["link_bytes"] / dense["link_bytes"]
    return rows


def report(rows, command):
    L = ["# PyTorch DDP communication hooks on Gloo, side by side in one job", "",
         "Step time: rank 0, zero_grad to the end of step (median, p10-p90). Bytes: interface tx per step "
         "(all hosts' first ranks' counters summed) over the ranks. See `bench/ddp_hooks.py`.", "",
         f"Command: `{command}`", "",
         "| example | link | ranks | mode | step ms (p10-p90) | bytes/rank/step | vs ddp | inter-host bytes/step "
         "| test acc | test loss | same params |", "|---|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        acc = "-" if r["test_accuracy"] is None else f"{r['test_accuracy']:.4f}"
        inter = "-" if r["interhost_bytes"] is None else f"{r['interhost_bytes']:,.0f}"
        of_ddp = f"{r['bytes_vs_ddp']:.3f}x" if "bytes_vs_ddp" in r else "-"       # no ddp row in the job
        L.append(f"| {r['example']} | {r['bandwidth']} | {r['ranks']} | {r['label']} | {1e3 * r['step_s']:,.1f} "
                 f"({1e3 * r['step_s_p10']:,.1f}-{1e3 * r['step_s_p90']:,.1f}) | {r['link_bytes']:,.0f} | "
                 f"{of_ddp} | {inter} | {acc} | {r['test_loss']:.4f} | "
                 f"{'yes' if r['params_identical'] else 'NO'} |")
    return "\n".join(L) + "\n"


# -- the driver ---------------------------------------------------------------------------------------
def worker_argv(a, json_out, iface):
    return [sys.executable, "-m", "bench.ddp_hooks", "--worker", "--json-out", json_out, "--iface", iface,
            "--example", a.example, "--model", a.model, "--modes", ",".join(a.modes), "--warmup", str(a.warmup),
            "--rounds", str(a.rounds), "--turn", str(a.turn), "--batch-size", str(a.batch_size),
            "--powersgd-layout", a.powersgd_layout, "--master-port", str(a.master_port),
            "--gloo-timeout", str(a.gloo_timeout)]


def run(a, json_out, argv_of=worker_argv, env=None):
    """One job: 2+ ranks on this host in a fresh namespace (tbf on its lo), or on emulated hosts.
    ``argv_of(a, json_out, iface)``: the ranks' command line; ``env``: extra environment of the ranks."""
    from testbed.launch import JobFailed, run_job
    from bench.job import namespace

    env = {"PYTHONPATH": ROOT, **(env or {})}
    if not a.hosts:
        with namespace(BANDWIDTHS[a.bandwidth], TBF_BURST) as ns:
            try:
                return run_job(a.np, argv_of(a, json_out, "lo"), timeout=a.timeout, prefix=ns.prefix, env=env,
                               cwd=ROOT)
            except JobFailed as e:
                keep_output(a, e)
                raise
    from testbed.hosts import EmulatedHosts

    cluster = EmulatedHosts(a.hosts, rate=BANDWIDTHS[a.bandwidth])
    cluster.up(exclusive=True)       # alone: the measurement needs the link, and nobody may rebuild it meanwhile
    try:
        return run_job(a.hosts * a.slots, argv_of(a, json_out, "eth0"), timeout=a.timeout,
                       prefix=cluster.hosts[0].prefix, env=env, cwd=ROOT, hosts=cluster.host_list(a.slots),
                       interface="eth0")
    except JobFailed as e:
        cluster.kill_strays()        # our ranks on the other hosts (the launcher's kill does not cross ssh)
        keep_output(a, e)
        raise
    finally:
        cluster.close(keep=a.keep_hosts)


def keep_output(a, failed):
    """A failed job's whole output, every rank's first error included, in --out/job_failed.log (the
    exception keeps only its tail)."""
    if getattr(a, "out", None):
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "job_failed.log"), "w") as f:
            f.write(failed.output)


def driver(a):
    from bench.manifest import write_manifest

    command = "python -m bench.ddp_hooks " + shlex.join(sys.argv[1:])
    os.makedirs(a.out, exist_ok=True)
    write_manifest(a.out, command)
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "r.json")
        t0 = time.perf_counter()
        run(a, js)
        with open(js) as f:
            record = json.load(f)
    record.update(command=command, job_s=round(time.perf_counter() - t0, 1))
    with open(os.path.join(a.out, "record.json"), "w") as f:
        json.dump(record, f)
    rows = rows_of(record, a.bandwidth, a.hosts or None)
    with open(os.path.join(a.out, "rows.json"), "w") as f:
        json.dump(rows, f, indent=1)
    text = report(rows, command)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return rows


def add_job_args(p, master_port, gloo_timeout, timeout):
    """The arguments ``run()`` and ``init_group()`` read: where the ranks run, the torch.distributed
    group, the job's limit, and the worker's hidden ones. Shared with bench/time_to_accuracy.py."""
    p.add_argument("--bandwidth", default="100mbit", help=f"of {list(BANDWIDTHS)}: tbf on lo, or on every eth0")
    p.add_argument("--np", type=int, default=2, help="ranks on this host (without --hosts)")
    p.add_argument("--hosts", type=int, default=0, help="emulated hosts (testbed/hosts.py); 0: this host")
    p.add_argument("--slots", type=int, default=2, help="ranks per emulated host")
    p.add_argument("--keep-hosts", action="store_true", help="leave emulated hosts this run built up")
    p.add_argument("--master-port", type=int, default=master_port)
    p.add_argument("--gloo-timeout", type=int, default=gloo_timeout, help="seconds before a stuck collective raises")
    p.add_argument("--timeout", type=int, default=timeout, help="seconds for the job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    p.add_argument("--iface", default="lo", help=argparse.SUPPRESS)
    p.add_argument("--master-addr", default=None, help=argparse.SUPPRESS)


def check_job_args(p, a):
    """``add_job_args``' values: p.error naming the first bad one."""
    if a.bandwidth not in BANDWIDTHS:
        p.error(f"--bandwidth must be one of {list(BANDWIDTHS)}, got {a.bandwidth!r}")
    for name in ("np", "slots", "timeout", "gloo_timeout"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if not 0 <= a.hosts <= 32:
        p.error(f"--hosts must be 0..32, got {a.hosts}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--example", choices=EXAMPLES, default="digits", help="digits: the wide CNN; lm: char_lm's GPT")
    p.add_argument("--model", choices=("wide", "cnn"), default="wide",
                   help="digits: the wide CNN (6.3M parameters) or the small one (0.15M, for tests)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    add_job_args(p, master_port=29517, gloo_timeout=60, timeout=1800)
    p.add_argument("--warmup", type=int, default=3, help=f"steps of every mode alone first (> {START_POWERSGD_ITER})")
    p.add_argument("--rounds", type=int, default=20, help="turns of every mode after the warm-up")
    p.add_argument("--turn", type=int, default=1, help="steps of one mode in a row")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--powersgd-layout", choices=LAYOUTS, default="one-bucket",
                   help="one-bucket: the model in one DDP bucket; serial: DDP's buckets, each hook future waited "
                        "for; ddp-buckets: torch's hook as it is (fails on Gloo with several buckets)")
    p.add_argument("--out", default=None, help="results folder (bench/results/ddp_hooks_*)")
    a = p.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in a.modes if m not in MODES]
    if bad or not a.modes or len(set(a.modes)) != len(a.modes):
        p.error(f"--modes takes {list(MODES)}, each once; got {a.modes}")
    check_job_args(p, a)
    for name in ("rounds", "turn", "batch_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.warmup <= START_POWERSGD_ITER:
        p.error(f"--warmup must be more than {START_POWERSGD_ITER} (PowerSGD's dense steps), got {a.warmup}")
    if not a.worker and a.out is None:
        a.out = os.path.join(ROOT, "bench", "results", f"ddp_hooks_{a.example}_{a.bandwidth}"
                             + (f"_{a.hosts}hosts" if a.hosts else ""))
    return a


if __name__ == "__main__":
    args = parse_args()
    worker(args) if args.worker else driver(args)
