#!/usr/bin/env bash
# Launch torchrun on this node from environment variables, so one image/command serves every node.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 torchrun-multinode.sh -m gptcore.training.train gpt2-124m [k=v ...]
#
# Env:
#   NNODES           number of nodes (default 1: a single-node --standalone run), or MIN:MAX for an elastic
#                    run (c10d only): it starts once MIN nodes are there, and a host lost or added re-forms
#                    the job at the new size from the newest checkpoint (give MAX_RESTARTS > 0: each re-forming
#                    after a loss is a restart); node 0, the host on MASTER_ADDR, must be one that stays
#   NODE_RANK        this node's rank, 0..NNODES-1 (default: JOB_COMPLETION_INDEX of a Kubernetes
#                    Indexed Job, else 0). Node 0 must run on MASTER_ADDR (both backends: it hosts the store).
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
#   TORCHRUN_EXTRA_ARGS  appended verbatim (word-split), e.g. "--rdzv-conf=timeout=1800" (a --rdzv-conf
#                    there is merged with the launcher's own)
#   GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME  the interface the ranks talk over. Unset (NNODES > 1): the one
#                    the kernel routes MASTER_ADDR through (`python -m gptcore.launch route`), so a host with
#                    several interfaces, or whose hostname resolves to 127.0.0.1 (Debian's and Ubuntu's default
#                    /etc/hosts), does not pick loopback or the wrong network
#   AGENT_GRACE      seconds torchrun may live on once its workers have ended (default 300; NNODES > 1): an
#                    agent blocked on a rendezvous store behind a cut link is stopped then, not ~1,000 s later
#   LOCAL_ADDR       the address this node is known by (torchrun --local-addr; default: its own address on the
#                    route to MASTER_ADDR; over loopback, 127.0.0.1 + NODE_RANK). Set it where two nodes share an
#                    address (two containers with host networking on one host): torchrun tells nodes apart by
#                    address and PID, and PIDs repeat across containers
#   MASTER_WAIT      seconds to wait for MASTER_ADDR to resolve (default 300: a pod's DNS record appears once
#                    it runs) and, on every node but node 0, as long again for node 0's rendezvous store to
#                    answer on MASTER_PORT (nodes start in any order); then the node exits 2 with the reason
#   DRY_RUN=1        print the command instead of running it
# With NNODES > 1 every node also passes torchrun --local-addr (its own address on that route: the address
# the workers are handed for the store, whatever the hostname resolves to), and the c10d rendezvous store is
# hosted by node 0 when MASTER_ADDR is one of its own addresses (--rdzv-conf=is_host=true; every other node
# is_host=false) instead of each guessing from its hostname. So NODE_RANK=0 is the node on MASTER_ADDR with
# c10d too, and every node has its own NODE_RANK. NCCL_* variables (NCCL_IB_HCA, ...) pass through to the trainers unchanged.
set -euo pipefail

die() { echo "torchrun-multinode: $*" >&2; exit 2; }
is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }

[ $# -gt 0 ] || die "usage: torchrun-multinode.sh -m gptcore.training.train PRESET [section.key=value ...]"
nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-${JOB_COMPLETION_INDEX:-0}}
nproc=${NPROC_PER_NODE:-gpu}
port=${MASTER_PORT:-29500}
backend=${RDZV_BACKEND:-c10d}

min_nodes=${nnodes%%:*} max_nodes=${nnodes##*:}  # NNODES=2 is 2:2
is_int "$min_nodes" && is_int "$max_nodes" && [ "$min_nodes" -ge 1 ] && [ "$max_nodes" -ge "$min_nodes" ] \
    && [[ "$nnodes" =~ ^[0-9]+(:[0-9]+)?$ ]] \
    || die "NNODES must be a positive integer or MIN:MAX with 1 <= MIN <= MAX, got '$nnodes'"
is_int "$node_rank" || die "NODE_RANK must be an integer >= 0, got '$node_rank'"
[ "$node_rank" -lt "$max_nodes" ] \
    || die "NODE_RANK=$node_rank is out of range for NNODES=$nnodes (use 0..$((max_nodes - 1)))"
is_int "$nproc" || [[ "$nproc" =~ ^(gpu|cpu|auto)$ ]] \
    || die "NPROC_PER_NODE must be an integer or gpu|cpu|auto, got '$nproc'"
is_int "$port" || die "MASTER_PORT must be a port number, got '$port'"

shutdown=${SHUTDOWN_TIMEOUT:-300}
is_int "$shutdown" || die "SHUTDOWN_TIMEOUT must be a number of seconds, got '$shutdown'"
args=(--nproc-per-node="$nproc" --max-restarts="${MAX_RESTARTS:-0}")
rdzv_conf=()
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
if [ "$max_nodes" -eq 1 ]; then
    args+=(--standalone)
else
    [ -n "${MASTER_ADDR:-}" ] || die "MASTER_ADDR is required when NNODES=$nnodes > 1: the address of the \
node that hosts the rendezvous (node 0), reachable from every node"
    [[ "$backend" =~ ^(c10d|static)$ ]] || die "RDZV_BACKEND must be c10d or static, got '$backend'"
    [ "$backend" = c10d ] || [ "$min_nodes" -eq "$max_nodes" ] \
        || die "NNODES=$nnodes (elastic) needs RDZV_BACKEND=c10d: the static rendezvous has a fixed world"
    # each attempt's workers meet on a store of their own (a fresh port from rendezvous node 0), not on the
    # agents' long-lived one: there a restart's ranks need a key prefix they all agree on, and torch counts
    # a restart only on the host whose worker failed (TORCHELASTIC_RESTART_COUNT 0 on one host, 1 on the
    # other): the ranks never met and the job hung (#66). torch's own switch for it:
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
    # a name that does not resolve yet (node 0's pod DNS record) is asked again for MASTER_WAIT seconds
    wait_s=${MASTER_WAIT:-300}; [ "${DRY_RUN:-0}" = 1 ] && wait_s=0
    is_host=0 route='' store_host=0  # store_host: this node serves the rendezvous store (node 0 on MASTER_ADDR)
    if route=$("${PYTHON:-python}" -m gptcore.launch route "$MASTER_ADDR" "$wait_s"); then
        read -r ifname local_addr is_host <<<"$route"
        # torchrun tells nodes apart by (address, PID): two nodes on one machine over loopback (containers with
        # host networking) share 127.0.0.1, and containers' PIDs repeat, so their rendezvous never saw two
        # nodes (a CI run: node 0 waited out its join timeout). Each takes its own loopback address instead.
        if [[ "$local_addr" == 127.* ]] && [ "$node_rank" -gt 0 ]; then local_addr=127.0.0.$((1 + node_rank)); fi
        local_addr=${LOCAL_ADDR:-$local_addr}
        export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ifname} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$ifname}
        echo "torchrun-multinode: talking over $GLOO_SOCKET_IFNAME from $local_addr (GLOO_SOCKET_IFNAME, \
NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME)" >&2
        args+=(--local-addr="$local_addr")
    elif [ "${DRY_RUN:-0}" = 1 ]; then
        echo "torchrun-multinode: MASTER_ADDR=$MASTER_ADDR is unknown here: on the node, --local-addr and the \
socket interface come from its route to it" >&2
    else
        die "this node cannot reach MASTER_ADDR=$MASTER_ADDR (the line above says why)"
    fi
    case "$backend" in
        c10d) args+=(--nnodes="$nnodes" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$port"
                     --rdzv-id="${RDZV_ID:-gpt2}")
              # said, never guessed: node 0 on MASTER_ADDR serves the store, every other node is a client
              # (a guess from the hostname fails where it resolves to 127.0.0.1, and two guesses race)
              if [ -n "${route:-}" ]; then
                  if [ "$is_host" = 1 ] && [ "$node_rank" -eq 0 ]; then rdzv_conf+=(is_host=true) store_host=1
                  else rdzv_conf+=(is_host=false); fi
              fi ;;
        static) args+=(--nnodes="$nnodes" --node-rank="$node_rank" --master-addr="$MASTER_ADDR"
                       --master-port="$port")
                [ "$node_rank" -ne 0 ] || store_host=1 ;;
    esac
fi
# shellcheck disable=SC2206  # deliberate word splitting of a flag list
extra=(${TORCHRUN_EXTRA_ARGS:-})
for a in ${extra[@]+"${extra[@]}"}; do  # one --rdzv-conf: torchrun keeps only the last one it is given
    case "$a" in
        --rdzv-conf=*|--rdzv_conf=*) rdzv_conf+=("${a#*=}") ;;
        *) args+=("$a") ;;
    esac
done
[ ${#rdzv_conf[@]} -eq 0 ] || args+=(--rdzv-conf="$(IFS=,; echo "${rdzv_conf[*]}")")

cmd=("${PYTHON:-python}" -m torch.distributed.run "${args[@]}" "$@")
echo "torchrun-multinode: node $node_rank of $nnodes, $(env | grep -c '^NCCL_' || true) NCCL_* variable(s) set" >&2
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${cmd[@]}"; printf '\n'
    exit 0
fi
if [ "$max_nodes" -gt 1 ] && [ "$store_host" = 0 ]; then
    # a node that is not the store host gives up on node 0's store after the rendezvous' read_timeout
    # (60 s): started a minute before node 0 it failed, and node 0 then waited 600 s for it (gptcore/launch.py)
    "${PYTHON:-python}" -m gptcore.launch reach "$MASTER_ADDR" "$port" "$wait_s" \
        || die "node $node_rank cannot reach node 0's rendezvous store (the line above says why)"
fi
if [ "$max_nodes" -gt 1 ]; then
    # across hosts torchrun's agent can block for ~1,000 s on a rendezvous store behind a cut link after its
    # workers end: its life after them is bounded (gptcore/launch.py supervise)
    grace=${AGENT_GRACE:-300}
    is_int "$grace" || die "AGENT_GRACE must be a number of seconds, got '$grace'"
    exec "${PYTHON:-python}" -m gptcore.launch supervise "$grace" -- "${cmd[@]}"
fi
exec "${cmd[@]}"
