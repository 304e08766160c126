"""How the model spreads over the ranks: the trainer's one strategy object.

    single  one rank: the plain model
    ddp     every rank a whole replica; gradients all-reduced (gpt2-124m, and what fits a rank comfortably)
    fsdp    FSDP2 (`fully_shard` per transformer block, then the root): each rank holds 1/world of the weights,
            gradients and AdamW state, all-gathers a block's weights just before it runs and reduce-scatters
            its gradients after. Across nodes an HSDP mesh: shard within a node, replicate across nodes.

`auto` picks DDP while weights, gradients and AdamW state (16 bytes a parameter) take at most
DDP_SHARE of a rank's memory, FSDP2 otherwise, and says why. The loop does not care which: it calls
`gradient_sync` around micro-steps. Under FSDP every rank writes its own shard of a checkpoint
(gptcore/checkpoints/sharded.py: DCP, resharded on load), so a run continues on any world size and either
engine; `load_optimizer` puts a whole checkpoint's optimizer state (from DDP or one rank) into the shards.
Evaluation runs on `EvalReplica`: a whole copy of the model on every rank, refreshed from the shards, so
evaluations and samples run exactly as under DDP.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import psutil
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from gptcore import distributed
from gptcore.config import RunConfig
from gptcore.model.gpt import GPT, build_on

STATE_BYTES_PER_PARAM = 16  # fp32 weights 4 + gradients 4 + AdamW's two moments 8
DDP_SHARE = 0.4  # auto: DDP while the states take at most this share of a rank's memory (activations need the rest)


@dataclass
class Plan:
    kind: str  # single | ddp | fsdp
    why: str  # one line for the start-up log


def device_memory(device: torch.device) -> int:
    """Bytes a rank may hold: the card's total on CUDA, the host's available RAM shared by the local ranks on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def plan(cfg: RunConfig, env: distributed.Env) -> Plan:
    """Which engine this invocation trains with, from train.parallel (and for auto, from memory)."""
    asked = cfg.train.parallel
    if env.world == 1:
        return Plan("single", "one rank" + (f" (train.parallel={asked}: nothing to spread)" if asked != "auto" else ""))
    if asked != "auto":
        return Plan(asked, f"train.parallel={asked}{mesh_text(asked, env)}")
    need = cfg.model.approx_params() * STATE_BYTES_PER_PARAM
    have = device_memory(env.device)
    states = f"weights, gradients and AdamW state {need / 2**30:.1f} GiB of {have / 2**30:.1f} GiB per rank"
    if need <= DDP_SHARE * have:
        return Plan("ddp", f"auto: {states} fit a replica")
    if cfg.optim.name == "muon" or env.dtype == torch.float16:  # config.validate refuses these with fsdp
        return Plan("ddp", f"auto: {states}, but optim.name=muon / float16 train with DDP only")
    return Plan("fsdp", f"auto: {states} (over {DDP_SHARE:.0%}): sharded{mesh_text('fsdp', env)}")


def wrap(raw: GPT, kind: str, env: distributed.Env, bf16_grads: bool = False) -> torch.nn.Module:
    """The model the training step runs: raw itself (single), DDP around it, or raw sharded in place (fsdp;
    its parameters become DTensors, so the optimizer is built after this)."""
    if kind == "single":
        return raw
    if kind == "ddp":
        model = DDP(raw, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
        if bf16_grads:  # halves the all-reduce bytes (multi-node); gradients summed in bf16
            model.register_comm_hook(None, distributed.allreduce_in_bf16)
        return model
    # bf16 compute with fp32 master weights and fp32 gradient reduction; fp32 runs stay fp32 throughout
    mp = MixedPrecisionPolicy(param_dtype=env.dtype, reduce_dtype=torch.float32) \
        if env.dtype == torch.bfloat16 else MixedPrecisionPolicy()
    mesh = device_mesh(env)
    for block in raw.transformer.h:
        # reshard after forward (all-gather again in backward): the memory of one unsharded block at a time
        fully_shard(block, mesh=mesh, mp_policy=mp)
    # the root (embeddings, tied head, final norm) is used again at once by backward: keep it gathered
    fully_shard(raw, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return raw


def mesh_shape(env: distributed.Env) -> tuple[int, ...]:
    """(world,) on one node; (nodes, ranks per node) across nodes: HSDP shards within a node (fast links)
    and replicates across nodes (one gradient all-reduce between them)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world))
    return (env.world // local, local) if 1 < local < env.world and env.world % local == 0 else (env.world,)


def mesh_text(kind: str, env: distributed.Env) -> str:
    shape = mesh_shape(env)
    return f", HSDP: {shape[0]} replicas x {shape[1]} shards" if kind == "fsdp" and len(shape) == 2 else ""


def device_mesh(env: distributed.Env):
    shape = mesh_shape(env)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh(env.device.type, shape, mesh_dim_names=names)


def replica_groups(kind: str, env: distributed.Env) -> list[list[int]]:
    """The sets of ranks whose weights must be bitwise equal (replicas.Disagreements compares within each):
    every rank under DDP; under HSDP the ranks holding the same shard, one per node (rank r and r + local,
    ...); none under pure FSDP (no two ranks hold the same tensors) or on one rank."""
    if kind == "ddp":
        return [list(range(env.world))]
    shape = mesh_shape(env)
    if kind == "fsdp" and len(shape) == 2:
        nodes, local = shape
        return [[node * local + s for node in range(nodes)] for s in range(local)]
    return []


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextmanager
def gradient_sync(model: torch.nn.Module, on: bool):
    """A micro-step whose backward communicates gradients (`on`: the step's last) or only accumulates them:
    DDP's no_sync; under FSDP2 the gradients stay unsharded until the last micro-step, and so do the weights
    after each backward but the last (the next micro-step's forward all-gathers nothing: half the all-gathers
    of an accumulating step, for one unsharded copy of the weights held meanwhile)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(on)
        model.set_reshard_after_backward(on)
        yield
    else:
        with model.no_sync() if not on and hasattr(model, "no_sync") else nullcontext():
            yield


def load_optimizer(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Put a checkpoint's whole optimizer state (keyed by parameter index) into a sharded model's optimizer:
    each rank keeps its own shard of every moment."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    named = {"state": {order[i]: s for i, s in state["state"].items()},
             "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


class EvalReplica:
    """A whole, plain copy of a sharded model on every rank, for evaluation and samples: they run on it
    exactly as on an unsharded model (one rank may sample while the others wait; ranks may evaluate
    different numbers of batches). `refresh` (collective) copies the current weights into it."""

    def __init__(self, sharded: GPT, device: torch.device):
        self.sharded = sharded
        self.model = build_on(sharded.config, device)

    def refresh(self) -> None:
        full = get_model_state_dict(self.sharded, options=StateDictOptions(full_state_dict=True))
        self.model.load_state_dict(full)
