# Sourced by the job scripts in slurm/ (submit them from the repository root): site set-up, the
# Python to use, the first node of the allocation and a free port on it.
if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "error: run this inside a SLURM allocation: sbatch $0 ..., or bash $0 ... within salloc" >&2
    exit 2
fi
if [ -f slurm/site_env.sh ]; then source slurm/site_env.sh; fi  # module load ..., conda activate ...
PYTHON=${PYTHON:-python}
# The first node hosts the rendezvous; its name must resolve on every node of the job.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The batch script runs on the first node, so a port free here is free where the rendezvous listens.
# common.distributed.free_port's three lines: importing common would import torch, seconds for one number.
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
MASTER_PORT=${MASTER_PORT:-$(free_port)}
# CPUs: since Slurm 22.05 srun no longer inherits the job's --cpus-per-task, so the job scripts pass
# it on explicitly; without it each srun task gets one core, and N GPU workers share it.
# Asked for nothing (salloc without -c), srun's steps may use the node's CPUs, as before.
CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}
CPUS_FLAG=${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}
export HEAD_NODE MASTER_PORT PYTHON CPUS_PER_TASK CPUS_FLAG
# The threads each of N processes gets when they share one task's CPUs (torchrun's default is 1).
share_cpus() { local n=$(( CPUS_PER_TASK / $1 )); echo $(( n > 1 ? n : 1 )); }
# torchrun on every node of the job (srun starts one per node), meeting at a c10d rendezvous on the first.
# --max-restarts: a worker that dies takes the others down, and all restart, MAX_RESTARTS times (0 by
# default: a script without checkpoints would start over; requeue.sbatch sets 3), and a script with
# checkpoints resumes where it was. Restarted workers must not share torchrun's
# rendezvous store, where their dead predecessors' addresses linger (pytorch#135712; see docs/resume.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
run_torchrun() {
    srun --ntasks-per-node=1 $CPUS_FLAG "$PYTHON" -m torch.distributed.run \
        --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" --max-restarts="${MAX_RESTARTS:-0}" \
        --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$HEAD_NODE:$MASTER_PORT" \
        "$@"
}
