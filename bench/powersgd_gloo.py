"""Reproduction: torch's PowerSGD DDP hooks on Gloo (CPU), and what makes ``powerSGD_hook`` run there.

Each case is a separate 2-process job (torch.multiprocessing, Gloo on 127.0.0.1) training a 3-layer
MLP (64-256-256-10, rank-4 PowerSGD from step 2) for 6 steps; each ends within ``--timeout`` seconds
(the group's collective timeout is shorter), so a hang shows as "timed out". One line of JSON per case:

- ``ddp-buckets``: ``powerSGD_hook`` as it is, ``bucket_cap_mb=0.05`` (two buckets): fails, typically
  with Gloo's "Received data size doesn't match expected size", at the first compressed step;
- ``one-bucket``: the same hook, the model in one bucket (``bucket_cap_mb=100``): runs;
- ``serial``: the same hook with two buckets, each bucket's future waited for before the hook returns
  (a hook around torch's, torch untouched): runs;
- ``batched``: ``batched_powerSGD_hook``, one bucket: AssertionError in ``_orthogonalize`` (it is handed a
  2-D matrix, and asserts a 3-D batch), on any backend;
- ``--threads N``: Gloo worker threads of the process group (default 2);
- ``--variant V``: one DDP or PowerSGDState option changed in every case (``VARIANTS``), to see
  whether it makes ``ddp-buckets`` run.

    python -m bench.powersgd_gloo [--cases ddp-buckets,one-bucket,serial,batched] [--threads 1]
    python -m bench.powersgd_gloo --cases ddp-buckets --variant static_graph
"""
import argparse
import datetime
import json
import os
import socket
import subprocess
import sys

CASES = ("ddp-buckets", "one-bucket", "serial", "batched")
VARIANTS = {"none": ({}, {}), "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, {}),
            "static_graph": ({"static_graph": True}, {}), "float64": ({}, {}),
            "no_error_feedback_no_warm_start": ({}, {"use_error_feedback": False, "warm_start": False}),
            "orthogonalization_epsilon": ({}, {"orthogonalization_epsilon": 1e-8}),
            "rank1": ({}, {"matrix_approximation_rank": 1}),
            "min_compression_rate_1": ({}, {"min_compression_rate": 1})}


def rank_main(rank, case, variant, threads, port, result_dir):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    opts = dist.ProcessGroupGloo._Options()
    opts._threads = threads
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20), pg_options=opts)
    torch.manual_seed(0)
    dtype = torch.float64 if variant == "float64" else torch.float32
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(dtype)
    ddp_options, state_options = VARIANTS[variant]
    ddp = DDP(model, bucket_cap_mb=0.05 if case in ("ddp-buckets", "serial") else 100, **ddp_options)
    state = psgd.PowerSGDState(None, **{"matrix_approximation_rank": 4, "start_powerSGD_iter": 2, **state_options})
    hook = psgd.batched_powerSGD_hook if case == "batched" else psgd.powerSGD_hook
    if case == "serial":
        def serial_powerSGD_hook(state, bucket):      # DDP requires the name `bucket`
            fut = psgd.powerSGD_hook(state, bucket)
            fut.wait()
            return fut
        hook = serial_powerSGD_hook
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(6):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(32, 64, generator=gen).to(dtype), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"identical": bool(torch.equal(flat, ref)), "buckets": sorted(state.error_dict),
                   "compression_rate": state.compression_stats()[0]}, f)
    dist.destroy_process_group()


def run_case(case, variant, threads, timeout):
    """Run one case as its own 2-process job; returns its outcome as a dict."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        procs = [subprocess.Popen([sys.executable, "-m", "bench.powersgd_gloo", "--rank", str(r), "--cases", case,
                                   "--variant", variant, "--threads", str(threads), "--port", str(port),
                                   "--result-dir", tmp],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outcome = {"case": case, "variant": variant, "threads": threads}
        try:
            outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.communicate()
            return {**outcome, "result": f"timed out after {timeout} s"}
        ranks = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        if all(p.returncode == 0 for p in procs) and all(map(os.path.exists, ranks)):
            done = [json.load(open(path)) for path in ranks]
            return {**outcome, "result": "ran", **done[0], "identical": all(d["identical"] for d in done)}
        lines = [ln.strip() for out in outputs for ln in out.splitlines()]
        # the first rank's own message first (Gloo's size check, torch's collective check), then any error
        for key in ("doesn't match", "mismatch between collectives", "Error"):
            found = [ln for ln in lines if key in ln]
            if found:
                break
        return {**outcome, "result": "failed", "exit_codes": [p.returncode for p in procs],
                "error": found[0][:400] if found else outputs[0][-300:]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    p.add_argument("--threads", type=int, default=2, help="Gloo worker threads of the process group")
    p.add_argument("--variant", choices=list(VARIANTS), default="none", help="a DDP or PowerSGDState option changed")
    p.add_argument("--timeout", type=int, default=180, help="seconds per case")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    if not cases or any(c not in CASES for c in cases) or a.threads < 1:
        p.error(f"--cases takes {list(CASES)}, --threads at least 1; got {a.cases!r}, {a.threads}")
    if a.rank is not None:
        return rank_main(a.rank, cases[0], a.variant, a.threads, a.port, a.result_dir)
    for case in cases:
        print(json.dumps(run_case(case, a.variant, a.threads, a.timeout)), flush=True)


if __name__ == "__main__":
    main()
