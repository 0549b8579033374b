"""The harness's command line: ``python -m bench <subcommand>`` (docs/benchmarks.md).

    python -m bench run --task cnn-wide --link 100mbit --arms "horovod dense,topkef,ddp powersgd r4" \\
        --steps 200 --eval-every 10 --out bench/results/run_cnn-wide_100mbit
    python -m bench report bench/results/run_cnn-wide_100mbit     # table, summary, plots again
    python -m bench demo                                           # dense Horovod vs TopKEF, 2 ranks
    python -m bench select | scale | peer-tests --horovod-source DIR | ab "CMD A" "CMD B"

The one argument parser of bench/; each subcommand's work is in its module.
"""
import argparse
import importlib
import os
import shlex
import signal
import sys

from bench.manifest import write_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def load(name):
    """Module ``bench.<name>``, imported when its subcommand runs: the runner's modules need Horovod,
    which ``select`` (run on GPU machines without it, scripts/gpu_check.sh) and ``ab`` do not."""
    return importlib.import_module(f"bench.{name}")


def split_arms(text):
    """Arm names separated by commas outside brackets: ``a,b[x=1,y=2]`` -> ``['a', 'b[x=1,y=2]']``."""
    names, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            names.append(current.strip())
            current = ""
        else:
            current += ch
    return [n for n in names + [current.strip()] if n]


def numbers(kind):
    """An argparse type: comma-separated values of ``kind``."""
    def parse(text):
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}")
    return parse


def parser():
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")

    r = sub.add_parser("run", help="train arms side by side in one job: step time, bytes, time to targets")
    r.add_argument("--task", default="cnn-wide", help="a task of bench/tasks.py's TASKS")
    r.add_argument("--arms", default="horovod dense,topkef,hvd_topk",
                   help="comma-separated names of bench/arms.py's ARMS, each optionally with [key=value,...]")
    r.add_argument("--link", default="unlimited", help="unlimited, 1gbit or 100mbit: the tbf rate of the link")
    r.add_argument("--np", type=int, default=2, help="ranks on this host (without --hosts)")
    r.add_argument("--hosts", type=int, default=0, help="emulated hosts (testbed/hosts.py); 0: this host")
    r.add_argument("--slots", type=int, default=2, help="ranks per emulated host")
    r.add_argument("--keep-hosts", action="store_true", help="leave emulated hosts this run built up")
    r.add_argument("--launcher", choices=("gloo", "mpi"), default="gloo",
                   help="horovodrun --gloo, or mpirun (across hosts: shared memory inside a host)")
    r.add_argument("--steps", type=int, default=200, help="steps per arm: --warmup alone, the rest in turns (auto: as many in turns after its warm-up)")
    r.add_argument("--warmup", type=int, default=3, help="steps of each arm alone first (PowerSGD: > 2)")
    r.add_argument("--max-warmup", type=int, default=600,
                   help="hvd_topk auto: steps allowed for its probe and trial (at most 5 plans x 4 steps x 10 rounds)")
    r.add_argument("--turn", type=int, default=5, help="steps of one arm in a row")
    r.add_argument("--eval-every", type=int, default=10, help="evaluate after every N-th step of an arm")
    r.add_argument("--targets", type=numbers(float), default=[],
                   help="fixed targets: accuracies (reached at or above) or losses (at or below)")
    r.add_argument("--seeds", type=numbers(int), default=[0], help="each in turn, in one job")
    r.add_argument("--batch-size", type=int, default=None, help="per rank (default: the task's, 16)")
    r.add_argument("--ratio", type=float, default=0.01, help="Top-K ratio of the topkef and hvd_topk arms")
    r.add_argument("--min-numel", type=int, default=None, help="TopKEF's min_numel (default: its own, 1024)")
    r.add_argument("--optimizer", choices=("sgd", "nesterov", "adam", "adamw"), default=None,
                   help="instead of the task's (nesterov: SGD with Nesterov's momentum)")
    r.add_argument("--lr", type=float, default=None, help="instead of the task's")
    r.add_argument("--non-iid", action="store_true", help="label shards (LM: text slices) per rank")
    r.add_argument("--cycle-ms", type=float, default=None, help="HOROVOD_CYCLE_TIME (default: Horovod's, 1 ms)")
    r.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment of the ranks")
    r.add_argument("--gloo-timeout", type=int, default=300, help="seconds before a stuck Gloo collective raises")
    r.add_argument("--timeout", type=int, default=3600, help="seconds per seed")
    r.add_argument("--master-port", type=int, default=29517, help="torch.distributed's store (DDP arms)")
    r.add_argument("--out", default=None, help="results folder (default bench/results/run_<task>_<link>)")
    r.add_argument("--title", default=None, help="headline.json's title (default: made from the setup)")
    r.add_argument("--page", default=None, help="headline.json's page: the docs/ study page of the run")

    rep = sub.add_parser("report", help="table.md, summary.json, plots and headline.json again from records.json")
    rep.add_argument("folder")

    d = sub.add_parser("demo", help="the main job: digits CNN, dense Horovod vs TopKEF, bytes in a namespace")
    d.add_argument("--np", type=int, default=2)
    d.add_argument("--ratio", type=float, default=0.01)
    d.add_argument("--epochs", type=int, default=20)
    d.add_argument("--timeout", type=int, default=900)
    d.add_argument("--across-hosts", action="store_true", help="2 emulated hosts, bytes between them on eth0")
    d.add_argument("--rate", default=None, help="--across-hosts: tbf rate of each host's eth0, e.g. 1gbit")

    s = sub.add_parser("select", help="the exact Top-K selection against torch.topk: speed and memory")
    s.add_argument("--sizes", type=lambda t: [load("selection").parse_size(v) for v in t.split(",")], default="1M,10M,25M,100M",
                   help="comma-separated element counts (K/M/G suffixes)")
    s.add_argument("--ratios", type=numbers(float), default="0.1,0.01,0.001", help="fractions kept, in (0, 1]")
    s.add_argument("--dtypes", type=lambda t: t.split(","), default="fp32", help="of fp32,fp16,bf16")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    s.add_argument("--repeats", type=int, default=5, help="timed repeats per method (median reported)")
    s.add_argument("--out", default=os.path.join(RESULTS, "select"))
    s.add_argument("--seed", type=int, default=0)

    c = sub.add_parser("scale", help="which collective the cost model picks, by workers, bandwidth and density")
    c.add_argument("--out", default=os.path.join(RESULTS, "scale"))
    c.add_argument("--message-mb", type=float, default=100.0, help="dense gradient message, MB (1e6 B)")
    c.add_argument("--alpha", type=float, default=50e-6, help="latency per message, s (fitted: stats()['alpha'])")
    c.add_argument("--beta", type=float, nargs="+", help="s per byte of each link instead of the nominal four")
    c.add_argument("--index-bytes", type=int, default=4)
    c.add_argument("--value-bytes", type=int, default=4)

    t = sub.add_parser("peer-tests", help="Horovod's own optimizer tests with each front door swapped in")
    t.add_argument("--horovod-source", required=True, help="a Horovod source tree at v0.28.1")
    t.add_argument("--front-door", default="topkef",
                   help="horovod, topkef, topkef_unnamed, topkef_class, hvd_topk, powersgd, powersgd_class or "
                        "hvd_topk_powersgd")
    t.add_argument("--ratio", type=float, default=0.01)
    t.add_argument("--np", type=int, default=2)
    t.add_argument("--timeout", type=int, default=120)
    t.add_argument("--tests", nargs="+", default=None, help="default: every optimizer test of bench/peer_tests.py")
    t.add_argument("--without-muon", action="store_true", help="leave torch.optim.Muon out of the tests' lists")

    a = sub.add_parser("ab", help="A/B timer of two whole commands, interleaved")
    a.add_argument("a", help="command A (run by sh -c)")
    a.add_argument("b", help="command B")
    a.add_argument("--repeats", type=int, default=3, help="counted rounds of A and B")
    a.add_argument("--warmup", type=int, default=1, help="rounds first, not counted")
    a.add_argument("--timeout", type=int, default=3600, help="seconds per command")
    a.add_argument("--out", default=None, help="folder for ab.json, table.md and the manifest")
    return p


def check_run(p, a):
    """The run's values: p.error naming the first bad one; fills in arms and out."""
    if a.task not in load("tasks").TASKS:
        p.error(f"--task must be one of {list(load('tasks').TASKS)}, got {a.task!r}")
    if a.link not in load("links").LINKS:
        p.error(f"--link must be one of {list(load('links').LINKS)}, got {a.link!r}")
    try:
        a.arms = split_arms(a.arms)
        for name in a.arms:
            load("arms").parse_arm(name)
    except ValueError as e:
        p.error(f"--arms: {e}")
    if not a.arms or len(set(a.arms)) != len(a.arms):
        p.error(f"--arms takes each arm once, got {a.arms}")
    for name in ("np", "slots", "steps", "turn", "eval_every", "timeout", "gloo_timeout"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if not 0 <= a.warmup < a.steps:
        p.error(f"--warmup must be at least 0 and less than --steps ({a.steps}), got {a.warmup}")
    if any("powersgd" in n for n in a.arms) and a.warmup <= 2:
        p.error(f"--warmup must be more than 2 (PowerSGD's dense steps) with a powersgd arm, got {a.warmup}")
    if not 0 <= a.hosts <= 32:
        p.error(f"--hosts must be 0..32, got {a.hosts}")
    if not 0 < a.ratio <= 1:
        p.error(f"--ratio must be in (0, 1], got {a.ratio}")
    if not a.seeds or (a.batch_size is not None and a.batch_size < 1) or (a.cycle_ms is not None and a.cycle_ms < 0):
        p.error("--seeds needs a seed, --batch-size must be at least 1 and --cycle-ms at least 0")
    if a.page and not (a.page.startswith("docs/") and a.page.endswith(".md") and os.path.isfile(os.path.join(ROOT, a.page))):
        p.error(f"--page must name a docs/....md page of the repository, got {a.page!r}")
    bad = [kv for kv in a.env if "=" not in kv or not kv.split("=", 1)[0]]
    if bad:
        p.error(f"--env takes KEY=VALUE, got {bad}")
    a.out = a.out or os.path.join(RESULTS, f"run_{a.task}_{a.link}" + (f"_{a.hosts}hosts" if a.hosts else ""))


def run(a):
    """The ``run`` subcommand: the jobs, then the report; returns the exit status."""
    links, runner, report = load("links"), load("runner"), load("report")
    lacks = links.missing(a.link, a.hosts)
    if lacks:
        print("bench run: cannot run here; missing: " + "; ".join(lacks), file=sys.stderr)
        return 2
    write_manifest(a.out, a.command)
    spec = {k: getattr(a, k) for k in ("task", "arms", "link", "hosts", "launcher", "steps", "warmup", "max_warmup",
                                       "turn", "eval_every", "batch_size", "ratio", "min_numel", "optimizer", "lr",
                                       "non_iid", "cycle_ms", "env", "gloo_timeout", "master_port")}
    sampler = links.LoadSampler()
    sampler.start()
    try:
        with links.place(a.link, a.np, a.hosts, a.slots, a.keep_hosts) as placement:
            print(f"bench run: {', '.join(a.arms)}; {placement.describe(a.link)}; seeds {a.seeds}", flush=True)
            env = runner.job_env(a.cycle_ms, a.gloo_timeout, a.env)
            records = runner.drive(spec, a.seeds, placement, env, a.timeout, a.launcher, a.out)
    finally:
        sampler.done.set()
    report.write(a.out, records, a.command, a.targets, a.title, a.page, sampler.samples)
    with open(os.path.join(a.out, "table.md")) as f:
        print(f.read())
    return 0


def main(argv=None):
    """Parse ``argv`` and run its subcommand; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    # SIGTERM unwinds like Ctrl-C: the job is killed, the namespace or hosts taken down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = parser()
    a = p.parse_args(argv)
    a.command = "python -m bench " + shlex.join(argv)       # as the manifest records it
    if a.subcommand == "run":
        check_run(p, a)
        return run(a)
    if a.subcommand == "report":
        load("report").rebuild(a.folder)
        with open(os.path.join(a.folder, "table.md")) as f:
            print(f.read())
        return 0
    modules = {"demo": "demo", "select": "selection", "scale": "scale", "peer-tests": "peer_tests", "ab": "ab"}
    try:
        return load(modules[a.subcommand]).main(a)
    except ValueError as e:              # a bad value the module found: a usage error naming it
        p.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
