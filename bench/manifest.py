"""Provenance of a results folder: which commit, which command, when, on what machine.

Every benchmark writes ``manifest.json`` next to its results (``write_manifest``), so a number in a
report can be traced to the code that produced it and the machine it ran on.
"""
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Environment variables that change what a run measures: the default command starts with those set, so
# that it reproduces the run (``HVD_TOPK_SPIN_WAIT=1 python -m bench run ...``). Horovod's own too.
MEASURED_ENV = ("HVD_TOPK_SPIN_WAIT",)
MEASURED_ENV_PREFIXES = ("HOROVOD_",)


def git_commit(root=ROOT):
    """``git rev-parse HEAD`` of the checkout, with ``-dirty`` when tracked files differ from it; None
    outside a git checkout.

    ``HVD_TOPK_COMMIT``, when set, is taken instead: a copy of the tree sent to another machine (a GPU
    machine, say) may carry no .git, or a stale one, and only whoever made the copy knows its commit."""
    if os.environ.get("HVD_TOPK_COMMIT"):
        return os.environ["HVD_TOPK_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def machine():
    """Cores, CPU model, GPU (or None), OS and library versions of this machine."""
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    facts = {"cores": os.cpu_count(), "cpu": cpu, "gpu": None, "os": f"{platform.system()} {platform.release()}",
             "python": platform.python_version()}
    try:
        import torch            # optional: a results folder made where torch is missing still gets one
        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    try:
        import horovod          # optional, as torch
        facts["horovod"] = horovod.__version__
    except ImportError:
        pass
    return facts


def manifest(command=None):
    """The manifest as a dict: commit, command (this process's argv by default, after the
    ``MEASURED_ENV`` variables that are set), UTC date, machine."""
    if command is None:
        argv = list(sys.argv)
        if argv and argv[0].endswith(".py"):   # python -m bench: argv[0] is bench/__main__.py
            rel = os.path.relpath(os.path.abspath(argv[0]), ROOT)
            module = rel[:-3].replace(os.sep, ".").removesuffix(".__main__")
            argv[0] = ("-m " + module) if rel.startswith("bench") else rel
        env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
               if k in MEASURED_ENV or k.startswith(MEASURED_ENV_PREFIXES)]
        command = " ".join(env + ["python", argv[0]] + [shlex.quote(a) for a in argv[1:]])
    return {"commit": git_commit(), "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine()}


def write_manifest(folder, command=None):
    """Write ``folder/manifest.json`` (see ``manifest``); returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "manifest.json")
    facts = manifest(command)    # before the file is opened: truncating a tracked manifest dirties the checkout
    with open(path, "w") as f:
        json.dump(facts, f, indent=1)
        f.write("\n")
    return path
