"""Real runs of ``python -m bench run`` (2 ranks, horovodrun and Gloo unless a test names mpirun, a fresh
network namespace), read from their results folders: every arm trains in one job, the parameters are
identical on every rank, the link bytes are real and near what each scheme must send, the curves and
targets come out; and the slow ones: tbf links, auto's warm-up, SIGTERM's clean-up, accuracy against
dense, emulated hosts."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from bench import results_page
from testbed.hosts import missing_requirements

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_netns = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                                 reason="needs root, ip and tc (network namespaces with tbf)")
pytestmark = [pytest.mark.multirank, needs_netns]


def bench_run(out, *argv, timeout=900):
    """``python -m bench run ... --out out``; returns its summary.json. (It inherits the ``hvd`` fixture's
    MPI singleton variables, if that ran first; testbed/launch.py's ``run_job`` drops them.)"""
    proc = subprocess.run([sys.executable, "-m", "bench", "run", *argv, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout + 60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory):
    """One job of the small digits CNN with Horovod's, TopKEF's, hvd_topk's and DDP's arms: 3 steps of
    each alone, then turns of 2 until 9 steps, an evaluation every 3 steps."""
    out = tmp_path_factory.mktemp("run")
    arms = "horovod dense,horovod fp16,topkef,hvd_topk,ddp,ddp fp16,ddp powersgd r2,ddp powersgd r4"
    return out, bench_run(out, "--task", "cnn", "--arms", arms, "--steps", "9", "--eval-every", "3", "--turn", "2",
                          "--targets", "0,1", "--timeout", "300", timeout=300)


def test_every_arm_trains_and_ends_identical_on_every_rank(every_kind):
    out, s = every_kind
    records = json.loads((out / "records.json").read_text())["records"]
    assert s["setup"]["ranks"] == 2 and s["setup"]["cycle_ms"] is None and s["reference"] == "horovod dense"
    for name, arm in records[0]["arms"].items():
        assert [c[0] for c in arm["curve"]] == [3, 6, 9] and arm["steps"] == 9, name
        assert len(arm["step_s"]) == 9 and len(arm["measured_s"]) == 3, name      # 3 turns of 2, the first steps out
        assert s["arms"][name]["params_identical"] and 0 < s["arms"][name]["final_accuracy"] <= 1, name
        assert s["arms"][name]["targets"]["accuracy 0"]["per_seed"] == [[arm["curve"][0][1], 3]]
        assert s["arms"][name]["targets"]["accuracy 1"]["train_s"] is None
    # the two libraries' dense arms train the same model on the same batches
    assert s["arms"]["horovod dense"]["final_accuracy"] == pytest.approx(s["arms"]["ddp"]["final_accuracy"], abs=0.02)


def test_link_bytes_are_real_and_near_the_schemes(every_kind):
    _, s = every_kind
    a = s["arms"]
    # 0.15M fp32 gradients, a ring of 2 ranks: each rank sends about one copy (605 kB) per step
    for dense in ("horovod dense", "ddp"):
        assert 0.97 < a[dense]["bytes"] / a["horovod dense"]["theoretical_bytes"] < 1.15, (dense, a[dense]["bytes"])
    for fp16 in ("horovod fp16", "ddp fp16"):
        assert 0.45 < a[fp16]["bytes"] / a["horovod dense"]["bytes"] < 0.6, fp16
    assert a["ddp powersgd r2"]["bytes"] < a["ddp powersgd r4"]["bytes"] < 0.1 * a["horovod dense"]["bytes"]
    assert a["ddp powersgd r2"]["powersgd_compression_rate"] > a["ddp powersgd r4"]["powersgd_compression_rate"] > 5
    assert a["topkef"]["bytes"] < 0.2 * a["horovod dense"]["bytes"] and a["topkef"]["scheme"] == "split_reduce"
    assert a["hvd_topk"]["stats"]["bytes_sent"] > 0 and a["hvd_topk"]["stats"]["density"] == 0.01


def test_the_folder_holds_every_file(every_kind):
    out, _ = every_kind
    for name in ("table.md", "summary.json", "records.json", "curves.png", "steps.png", "manifest.json"):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "manifest.json").read_text())["command"].startswith("python -m bench run --task cnn")
    assert results_page.read_headline(str(out / "headline.json"))["rows"]
    assert "| ddp powersgd r4 |" in (out / "table.md").read_text()


@pytest.mark.slow
def test_tbf_link_bytes_against_the_theoretical(tmp_path):
    """The wide CNN through a 1 Gbit/s tbf link: every compressed arm within 0.9x-1.1x of the payload its
    scheme must send (``theoretical_bytes``, exact at 2 ranks: the packed wire's headers, frames and
    block counts included; the link adds TCP/IP headers, ACKs and Horovod's control plane, so below 0.9
    the model overstates the wire, above 1.1 the wire grew) and under 1/20 of dense's bytes; the default
    16-bit values send at most 3/4 of fp32's. A 20 ms Horovod cycle: at Horovod's 1 ms, its control plane
    adds about 100 kB to a 270 ms TopKEF step (measured 1.20x the payload), which is not what this checks."""
    s = bench_run(tmp_path, "--link", "1gbit", "--arms", "horovod dense,topkef,hvd_topk artopk,hvd_topk allgather,"
                  "hvd_topk allgather fp32", "--steps", "12", "--turn", "3", "--eval-every", "12", "--cycle-ms", "20")
    a = s["arms"]
    assert a["horovod dense"]["bytes"] >= 0.95 * a["horovod dense"]["theoretical_bytes"]
    for name in ("topkef", "hvd_topk artopk", "hvd_topk allgather", "hvd_topk allgather fp32"):
        assert 0.9 <= a[name]["measured_over_theoretical"] <= 1.1, (name, a[name]["measured_over_theoretical"])
        assert a[name]["bytes"] <= a["horovod dense"]["bytes"] / 20, name
    # Payload at ratio 0.01: 63,306 entries of 4 compressed tensors in one bucket, 4 bytes each in bf16
    # (value + 16-bit offset) against 6 in fp32, beside the same frame, header, block counts and dense
    # 1-D tensors (18 kB): 271 kB against 398 kB, 0.68. An overhead X common to both (control plane,
    # headers) gives (271 + X) / (398 + X), 0.70 at the 27 kB the 1.1 bound leaves the bf16 arm; even
    # the bf16 arm at 1.1x against the fp32 arm at its bare payload gives 0.75 (and TCP's headers keep
    # the fp32 arm above its payload). fp32 values on the default arm would make it about 1.
    assert a["hvd_topk allgather"]["theoretical_bytes"] <= 0.7 * a["hvd_topk allgather fp32"]["theoretical_bytes"]
    assert a["hvd_topk allgather"]["bytes"] <= 0.75 * a["hvd_topk allgather fp32"]["bytes"]


@pytest.mark.slow
def test_auto_runs_its_probe_and_trial_alone_first(tmp_path):
    s = bench_run(tmp_path, "--task", "cnn", "--arms", "horovod dense,hvd_topk auto", "--steps", "12", "--turn", "2",
                  "--eval-every", "12", "--max-warmup", "600")
    record = json.loads((tmp_path / "records.json").read_text())["records"][0]
    auto = record["arms"]["hvd_topk auto"]
    dense = record["arms"]["horovod dense"]
    # its warm-up ran past --warmup; then as many steps in turns as dense
    assert auto["steps"] > 12 and dense["steps"] == 12 and len(auto["measured_s"]) == len(dense["measured_s"]) == 4
    assert any(str(h[3]).startswith("trial, ") for h in auto["auto"]["history"])
    assert s["auto"]["fastest_fixed"] == "horovod dense" and s["auto"]["met"] is not None   # JSON: lists


@pytest.mark.slow
def test_sigterm_kills_the_job_and_deletes_its_namespace(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "bench", "run", "--task", "cnn", "--steps", "2000", "--out",
                             str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    prefix = f"hvdtopk-run{proc.pid}-"
    try:
        deadline = time.monotonic() + 240
        while not any(p.name().startswith("python") and "bench.runner" in " ".join(p.cmdline())
                      for p in psutil.Process(proc.pid).children(recursive=True)):
            assert time.monotonic() < deadline and proc.poll() is None, "no rank started"
            time.sleep(0.5)
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, out
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert prefix not in spaces
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [p.pid for p in alive]


# The accuracy runs train under mpirun: what they test is what the optimizer does to accuracy, which no
# launcher changes (their figures came out the same to the bit under both, 2026-11-29), and a seed
# trained in 6-7 s under mpirun against 10 s under horovodrun's Gloo here (the digits run at 110 steps).
# Gloo's data path stays under test in every_kind above, the tbf link and the hosts below.
ACCURACY_LAUNCHER = ("--launcher", "mpi")


def digits_accuracy_against_dense(out, arm, *recipe):
    """Mean final accuracy of dense and of ``arm``, side by side: 3 seeds, 20 epochs of the small CNN at
    64 a rank (220 steps: the task's 20 epochs at 16 a rank in a quarter of the steps, whose cost is
    mostly fixed), the classifier's small layer dense (``--min-numel 2048``), ``recipe`` the optimizer's
    flags. Under mpirun (``ACCURACY_LAUNCHER``)."""
    s = bench_run(out, "--task", "cnn", "--seeds", "0,1,2", "--steps", "220", "--turn", "10", "--eval-every", "110",
                  "--batch-size", "64", "--min-numel", "2048", *recipe, "--arms", f"horovod dense,{arm}",
                  *ACCURACY_LAUNCHER, timeout=2400)
    return tuple(a["final_accuracy"] for a in s["arms"].values())


@pytest.mark.slow
def test_compressed_digits_within_one_point_of_dense(tmp_path):
    """SGD lr 0.1: ratio 0.001 with momentum correction and 4 warm-up epochs (allgather) within one point
    of dense SGD's mean accuracy (measured 2026-11-29: dense 0.9796, ours 0.9731, the same to the bit under
    horovodrun and mpirun, 40 s under mpirun and 56 s under horovodrun; at 16 a rank, 880 steps, 95-103 s
    in the suite)."""
    dense, ours = digits_accuracy_against_dense(
        tmp_path, "hvd_topk[communication=allgather,momentum_correction=true,warmup_epochs=4]",
        "--lr", "0.1", "--ratio", "0.001")
    assert dense > 0.95 and ours >= dense - 0.01, (dense, ours)


@pytest.mark.slow
def test_lm_update_without_local_momentum_within_one_and_a_half_percent_of_dense(tmp_path):
    """The LM at 2 blocks for 50 steps (its cosine schedule ends there): top-k 0.01 of each rank's AdamW
    update, allgather, no local momentum: its final test loss within 1.5% of dense AdamW's. Measured
    2026-11-30 in one run of the four arms (seed 0, mpirun): dense 2.453, the recipe 2.472 (+0.8%); the
    weaker configs fail the bound: local momentum on 2.653 (+8.2%), split_reduce 2.535 (+3.4%). (At 100
    steps, the test until that day at twice this cost: dense 2.270, the recipe +0.2%, local momentum
    +5.0%, split_reduce +1.7% against a 1% bound; at 200 and 400 steps the recipe held too.) The one
    accuracy test of the recipe docs/optimizer.md gives Adam-type optimizers: its run on the digits CNN
    with Adam (0.46 pt under dense, 54 s of the suite) left the suite on 2026-11-30; that figure stays in
    docs/studies/2026-11-accuracy-2-ranks.md."""
    s = bench_run(tmp_path, "--task", "lm-small", "--steps", "50", "--turn", "20", "--eval-every", "50", "--arms",
                  "horovod dense,hvd_topk[communication=allgather,compress=update,local_momentum=false]",
                  *ACCURACY_LAUNCHER, timeout=2400)
    base, ours = (a["final_loss"] for a in s["arms"].values())
    assert base < 2.55 and ours <= 1.015 * base, (base, ours)


@pytest.mark.slow
@pytest.mark.multihost
def test_across_two_emulated_hosts(tmp_path):
    """2 hosts x 1 rank, eth0 at 1 Gbit/s: the bytes are the hosts' eth0 traffic, dense's near one
    copy of the gradients per rank per step, TopKEF's far fewer."""
    if missing_requirements():
        pytest.skip("cannot emulate hosts here: " + "; ".join(missing_requirements()))
    s = bench_run(tmp_path, "--task", "cnn", "--hosts", "2", "--slots", "1", "--link", "1gbit", "--arms",
                  "horovod dense,topkef,ddp powersgd r4", "--steps", "9", "--turn", "2", "--eval-every", "9")
    a = s["arms"]
    assert s["setup"]["iface"] == "eth0" and all(x["params_identical"] for x in a.values())
    assert 0.9 * 605_000 < a["horovod dense"]["bytes"] < 1.3 * 605_000
    assert a["topkef"]["bytes"] < 0.2 * a["horovod dense"]["bytes"] and "theoretical_bytes" not in a["topkef"]
