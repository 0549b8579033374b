# shellcheck shell=bash
# Sourced by slurm/train_cpu.sbatch and slurm/train_gpu.sbatch: runs the training as one job step and
# turns Slurm's early warning into checkpoint + requeue + resume.
#
# The flow (both templates ask for `#SBATCH --signal=B:USR1@<seconds> --requeue --open-mode=append`):
#   1. Slurm sends SIGUSR1 to this batch shell <seconds> before the time limit (or a user does:
#      `scancel --signal=USR1 --batch <jobid>`).
#   2. The trap below forwards it to the launcher (srun or mpirun forward SIGUSR1 to every rank).
#   3. The training script records it, all ranks agree at the next step boundary (one allreduce of a
#      flag), every rank writes its own checkpoint (error-feedback residuals are per rank) and exits
#      with status 85 (EXIT_REQUEUE in examples/digits_cnn.py).
#   4. Seeing 85, this shell runs `scontrol requeue $SLURM_JOB_ID`: the same job id goes back to the
#      queue, runs this script again, and the training script resumes from its checkpoint.
# SIGTERM (scancel, preemption, the time limit itself) is forwarded too, so the ranks save what they
# can, but is never turned into a requeue here: scancel means stop, and Slurm requeues preempted jobs
# itself when PreemptMode=REQUEUE.
#
# Knobs (environment, exported by sbatch from the submitting shell):
#   HVD_TOPK_LAUNCHER  srun (default: `srun --mpi=pmix`, Slurm starts and signals every rank) or
#                      mpirun (Open MPI reads the allocation and starts its daemons through srun; for
#                      clusters whose Slurm has no PMIx plugin: check `srun --mpi=list`)
#   HVD_TOPK_ROOT      the repository (default: the directory sbatch was run from)
#   PYTHON             interpreter for a *.py script (default: the venv's python if present, the venv
#                      being $HVD_TOPK_VENV as scripts/install.sh made it, else $HVD_TOPK_ROOT/.venv;
#                      else python3)
#   HVD_TOPK_ARGS_FILE a tab-separated file; line SLURM_ARRAY_TASK_ID+1 is appended to the script's
#                      arguments (slurm/sweep.py writes it for job arrays)
#   HVD_TOPK_MAX_REQUEUES  stop requeueing after this many restarts (default 20): no endless loop

HVD_TOPK_EXIT_REQUEUE=85
HVD_TOPK_STEP_PID=""     # the launcher (srun/mpirun) of the running step
HVD_TOPK_SIGNALLED=""    # the last of USR1/TERM this shell received

# Record the signal and pass it on to the step. Installed as soon as this file is sourced, so that a
# signal before the step starts is recorded instead of killing the shell (bash's default action).
_hvd_topk_forward() {
    HVD_TOPK_SIGNALLED=$1
    if [ -n "$HVD_TOPK_STEP_PID" ]; then
        echo "job_step: SIG$1 received: forwarded to the ranks (SIGUSR1: checkpoint, exit 85)"
        kill "-$1" "$HVD_TOPK_STEP_PID" 2>/dev/null || true
    else
        echo "job_step: SIG$1 received before the step started"
    fi
}
trap '_hvd_topk_forward USR1' USR1
trap '_hvd_topk_forward TERM' TERM

# Build the per-rank command in HVD_TOPK_CMD from the sbatch arguments.
hvd_topk_command() {
    if [ "$#" -eq 0 ]; then
        echo "usage: sbatch $0 SCRIPT.py [ARGS...]   (or any command)" >&2
        return 2
    fi
    local python=${PYTHON:-}
    if [ -z "$python" ]; then
        local venv=${HVD_TOPK_VENV:-$HVD_TOPK_ROOT/.venv}
        if [ -x "$venv/bin/python" ]; then python=$venv/bin/python; else python=python3; fi
    fi
    HVD_TOPK_CMD=("$@")
    case "$1" in *.py) HVD_TOPK_CMD=("$python" "$@") ;; esac
    if [ -n "${HVD_TOPK_ARGS_FILE:-}" ]; then
        local line extra=()
        [ -n "${SLURM_ARRAY_TASK_ID:-}" ] || { echo "HVD_TOPK_ARGS_FILE needs a job array (sbatch --array)" >&2; return 2; }
        line=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" "$HVD_TOPK_ARGS_FILE")
        [ -n "$line" ] || { echo "$HVD_TOPK_ARGS_FILE has no line for array task $SLURM_ARRAY_TASK_ID" >&2; return 2; }
        IFS=$'\t' read -r -a extra <<<"$line"
        HVD_TOPK_CMD+=("${extra[@]}")
    fi
}

# Run HVD_TOPK_CMD on every task of the allocation; forward USR1/TERM; requeue on exit status 85.
hvd_topk_run() {
    local launcher=${HVD_TOPK_LAUNCHER:-srun} rc
    local step=()
    case "$launcher" in
        # --wait=60: once one rank has ended, the others get 60 s to end too, then are killed: a crashed
        # rank cannot leave the rest hanging in a collective, and ranks that checkpointed and exit 85
        # are not cut short (--kill-on-bad-exit would kill them mid-exit and turn 85 into 143).
        srun) step=(srun --mpi=pmix --kill-on-bad-exit=0 --wait=60
                    ${HVD_TOPK_SRUN_ARGS[@]+"${HVD_TOPK_SRUN_ARGS[@]}"}) ;;
        # --bind-to none: Slurm already confined each task. -x: in an allocation Open MPI's daemons are
        # started by srun and inherit the job's environment; -x also covers a site's ssh-started ones.
        # OMPI_ALLOW_RUN_AS_ROOT: containers and CI run as root.
        mpirun) step=(mpirun -np "$SLURM_NTASKS" --bind-to none -x PATH -x OMP_NUM_THREADS
                      ${PYTHONPATH:+-x PYTHONPATH})
                export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ;;
        *) echo "HVD_TOPK_LAUNCHER must be srun or mpirun, got '$launcher'" >&2; return 2 ;;
    esac
    echo "job_step: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST:" \
         "${step[*]} ${HVD_TOPK_CMD[*]}"
    # In the background, so that this shell runs its traps while the step runs (bash defers traps
    # until a foreground command returns).
    "${step[@]}" "${HVD_TOPK_CMD[@]}" &
    HVD_TOPK_STEP_PID=$!
    # `wait` returns early (status > 128) when a trap fires: wait again until the step is gone, then
    # once more for its exit status (bash keeps the status of a reaped background job).
    while kill -0 "$HVD_TOPK_STEP_PID" 2>/dev/null; do
        wait "$HVD_TOPK_STEP_PID" || true
    done
    rc=0
    wait "$HVD_TOPK_STEP_PID" || rc=$?
    HVD_TOPK_STEP_PID=""
    echo "job_step: step exited with status $rc"
    if [ "$rc" = "$HVD_TOPK_EXIT_REQUEUE" ] && [ "$HVD_TOPK_SIGNALLED" != TERM ]; then
        if [ "${SLURM_RESTART_COUNT:-0}" -ge "${HVD_TOPK_MAX_REQUEUES:-20}" ]; then
            echo "job_step: not requeueing: already restarted ${SLURM_RESTART_COUNT} times" >&2
            return "$rc"
        fi
        echo "job_step: checkpoint written; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        return 0
    fi
    return "$rc"
}
