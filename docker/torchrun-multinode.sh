#!/usr/bin/env bash
# Launch torchrun on this node from environment variables, so one image/command serves every node.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 torchrun-multinode.sh -m gptcore.training.train gpt2-124m [k=v ...]
#
# Env:
#   NNODES           number of nodes (default 1: a single-node --standalone run)
#   NODE_RANK        this node's rank, 0..NNODES-1 (default: JOB_COMPLETION_INDEX of a Kubernetes
#                    Indexed Job, else 0). Rank 0 must run on MASTER_ADDR for the static backend.
#   NPROC_PER_NODE   processes per node (default gpu: one per visible GPU; cpu/auto/an integer also work)
#   MASTER_ADDR      host every node can reach (required when NNODES > 1)
#   MASTER_PORT      rendezvous TCP port on MASTER_ADDR (default 29500)
#   RDZV_BACKEND     c10d (default: nodes may start in any order; ranks assigned at rendezvous) or
#                    static (--node-rank/--master-addr: node 0 is global rank 0)
#   RDZV_ID          job id shared by all nodes of one run (default gpt2)
#   MAX_RESTARTS     torchrun --max-restarts (default 0)
#   SHUTDOWN_TIMEOUT seconds torchrun gives its workers after SIGTERM before SIGKILL (default 300: time
#                    for the stop checkpoint; keep the container's/pod's grace period above it); torch 2.11's
#                    torchrun has no such flag: it is left out there, and torchrun's fixed 30 s apply
#   TORCHRUN_EXTRA_ARGS  appended verbatim (word-split), e.g. "--rdzv-conf=timeout=1800"
#   DRY_RUN=1        print the command instead of running it
# NCCL_* variables (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) pass through to the trainers unchanged.
set -euo pipefail

die() { echo "torchrun-multinode: $*" >&2; exit 2; }
is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }

[ $# -gt 0 ] || die "usage: torchrun-multinode.sh -m gptcore.training.train PRESET [section.key=value ...]"
nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-${JOB_COMPLETION_INDEX:-0}}
nproc=${NPROC_PER_NODE:-gpu}
port=${MASTER_PORT:-29500}
backend=${RDZV_BACKEND:-c10d}

is_int "$nnodes" && [ "$nnodes" -ge 1 ] || die "NNODES must be a positive integer, got '$nnodes'"
is_int "$node_rank" || die "NODE_RANK must be an integer >= 0, got '$node_rank'"
[ "$node_rank" -lt "$nnodes" ] || die "NODE_RANK=$node_rank is out of range for NNODES=$nnodes (use 0..$((nnodes - 1)))"
is_int "$nproc" || [[ "$nproc" =~ ^(gpu|cpu|auto)$ ]] \
    || die "NPROC_PER_NODE must be an integer or gpu|cpu|auto, got '$nproc'"
is_int "$port" || die "MASTER_PORT must be a port number, got '$port'"

shutdown=${SHUTDOWN_TIMEOUT:-300}
is_int "$shutdown" || die "SHUTDOWN_TIMEOUT must be a number of seconds, got '$shutdown'"
args=(--nproc-per-node="$nproc" --max-restarts="${MAX_RESTARTS:-0}")
# torchrun has --shutdown-timeout from torch 2.12; torch 2.11's exits 2 on it (gptcore/launch.py asks the
# installed torchrun's own parser: 0 it has it, 3 it has not, anything else: could not ask, keep the flag)
accepts=0
"${PYTHON:-python}" -m gptcore.launch accepts --shutdown-timeout 2>/dev/null || accepts=$?
if [ "$accepts" -eq 3 ]; then
    echo "torchrun-multinode: this torchrun has no --shutdown-timeout: it kills workers 30 s after SIGTERM, \
not SHUTDOWN_TIMEOUT=$shutdown s (torch >= 2.12 honours it)" >&2
else
    args+=(--shutdown-timeout="$shutdown")
fi
if [ "$nnodes" -eq 1 ]; then
    args+=(--standalone)
else
    [ -n "${MASTER_ADDR:-}" ] || die "MASTER_ADDR is required when NNODES=$nnodes > 1: the address of the \
node that hosts the rendezvous (node 0), reachable from every node"
    case "$backend" in
        c10d) args+=(--nnodes="$nnodes" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$port"
                     --rdzv-id="${RDZV_ID:-gpt2}") ;;
        static) args+=(--nnodes="$nnodes" --node-rank="$node_rank" --master-addr="$MASTER_ADDR"
                       --master-port="$port") ;;
        *) die "RDZV_BACKEND must be c10d or static, got '$backend'" ;;
    esac
fi
# shellcheck disable=SC2206  # deliberate word splitting of a flag list
[ -z "${TORCHRUN_EXTRA_ARGS:-}" ] || args+=(${TORCHRUN_EXTRA_ARGS})

cmd=("${PYTHON:-python}" -m torch.distributed.run "${args[@]}" "$@")
echo "torchrun-multinode: node $node_rank of $nnodes, $(env | grep -c '^NCCL_' || true) NCCL_* variable(s) set" >&2
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${cmd[@]}"; printf '\n'
    exit 0
fi
exec "${cmd[@]}"
