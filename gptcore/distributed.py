"""Process-group setup and hardware selection: one place decides device, backend, dtype and compile.

CUDA -> nccl, bf16 autocast (fp16 + GradScaler on GPUs without native bf16), TF32 matmuls, compile on.
CPU  -> gloo, fp32 (bf16 autocast if asked), compile only if asked.
Runs the same under `torchrun` (RANK/WORLD_SIZE/LOCAL_RANK in the environment) and as a plain process.
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gptcore.config import ConfigError, TrainConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Env:
    rank: int
    local_rank: int
    world: int
    device: torch.device
    dtype: torch.dtype  # autocast dtype (float32 = no autocast)
    compile: bool
    loss: str = "plain"  # the training loss head, gptcore/model/loss.py: fused | plain

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def ddp(self) -> bool:
        return self.world > 1

    def autocast(self):
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def world_size() -> int:
    """The world size torchrun announces (1 for a plain process); known before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def native_bf16(device_type: str) -> bool:
    """A GPU with bf16 tensor cores (Ampere and newer). torch also reports emulated bf16 on V100/T4
    (is_bf16_supported's default), which is slow and which Inductor does not compile."""
    return device_type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def select_dtype(pref: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on a GPU that has it natively, fp16 (with the trainer's GradScaler) on older GPUs."""
    if pref != "auto":
        return DTYPES[pref]
    if device.type == "cuda":
        return torch.bfloat16 if native_bf16("cuda") else torch.float16
    return torch.float32


def select_loss(pref: str, device: torch.device) -> str:
    """auto: the fused chunked loss on CPU (no logits-sized pages per step), the plain one on CUDA (the
    compiled plain loss fuses into a few kernels at the tensor-core-friendly padded width)."""
    if pref != "auto":
        return pref
    return "plain" if device.type == "cuda" else "fused"


def uses_cuda(tc: TrainConfig) -> bool:
    """Whether training runs on CUDA on this machine (train.device=auto: when a GPU is visible); the launcher
    asks too, to name what its processes hold (GPU-hours or CPU-process-hours)."""
    return tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available())


def select(tc: TrainConfig) -> Env:
    """This process's rank and hardware settings (from torchrun's environment; no communication)."""
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if tc.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    cuda = uses_cuda(tc)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        use_tf32()
        if tc.loss == "fused":
            print("warning: train.loss=fused on CUDA reads the loss back once per 256-row chunk (a host sync "
                  "each) and copies the head's weights per chunk: slower than train.loss=auto (plain) there",
                  file=sys.stderr, flush=True)
    compile_ = tc.compile == "true" or (tc.compile == "auto" and cuda)
    return Env(rank, local_rank, world_size(), device, select_dtype(tc.dtype, device), compile_,
               select_loss(tc.loss, device))


def use_tf32() -> None:
    """TF32 tensor cores for the fp32 parts. Through the fp32_precision settings where torch has them
    (2.9+): the older allow_tf32 switches are deprecated there, and mixing the two makes torch.compile fail."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(cudnn, "conv"):
        matmul.fp32_precision = "tf32"
        cudnn.conv.fp32_precision = "tf32"
    else:
        matmul.allow_tf32 = True
        cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")


def flight_recorder_env(trace_dir: Path) -> dict[str, str]:
    """NCCL's flight recorder, as environment (read when the process group is created): a trace buffer,
    a dump when NCCL's own watchdog sees a collective time out or fail, and where the dumps go. Both the
    older (TORCH_NCCL_*) and the newer (TORCH_FR_*) names, for every torch the project allows."""
    prefix = str(trace_dir / "nccl-trace-rank_")
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_FR_DUMP_TEMP_FILE": prefix}


def init_process_group(env: Env, hang_limit_s: float = 0.0, trace_dir: Path | None = None) -> None:
    """Join the process group (nccl on GPUs, gloo on CPU) when launched with more than one rank. Its
    timeout stays above the hang watchdog's limit (`hang_limit_s`), so a stuck collective is reported by
    the watchdog (stacks on disk, a restart) before the process group gives up on it. On NCCL the flight
    recorder writes to `trace_dir` (the run's hangs/ folder); settings the user made win."""
    if env.world > 1 and not dist.is_initialized():
        backend = "nccl" if env.device.type == "cuda" else "gloo"
        if backend == "nccl" and trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            for key, value in flight_recorder_env(trace_dir).items():
                os.environ.setdefault(key, value)
        # long: rank 0 alone may spend minutes on a checkpoint, a sample or a download
        timeout = timedelta(seconds=max(30 * 60, hang_limit_s + 10 * 60))
        store = restart_store(timeout)
        extra = {"store": store, "rank": env.rank, "world_size": env.world} if store is not None else {}
        dist.init_process_group(backend=backend, timeout=timeout, **extra,
                                device_id=env.device if env.device.type == "cuda" else None)


def sum_over_hosts(value: int, env: Env) -> int:
    """`value` as each host has it (its local rank 0's), summed over the hosts; every rank gets the sum."""
    if env.world == 1 or not dist.is_initialized():
        return value
    t = torch.tensor([value if env.local_rank == 0 else 0], dtype=torch.int64, device=env.device)
    dist.all_reduce(t)
    return int(t.item())


def restart_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun: a client of the agent's key-value store whose keys carry the restart count. The
    agent keeps one store for all of a job's restarts (--max-restarts), and the ranks of a restarted job
    would otherwise read their predecessors' addresses there (measured with gloo, torch 2.13: "Connection
    refused" from every rank of the restart). None outside torchrun (the plain env:// rendezvous)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size(),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"gptcore/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


# what gloo and NCCL raise (a plain RuntimeError from gloo) when the other end of a collective is gone: its
# process died, its host died, or the link between the hosts went down
PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused|"
                       r"remote process exited|No route to host")


class PeerLost(RuntimeError):
    """A collective lost its peer; the message names the step and the peer's address when the backend gave it."""


def lost_peer(e: BaseException) -> bool:
    return isinstance(e, dist.DistNetworkError) or (isinstance(e, RuntimeError) and bool(PEER_GONE.search(str(e))))


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (gloo has no AVG, so callers divide)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def allreduce_in_bf16(process_group, bucket):
    """DDP communication hook: all-reduce each gradient bucket in bf16 (half the bytes of fp32) and write
    the average back. PyTorch's own bf16 hook requires NCCL (DDP refuses it by its name elsewhere); this
    one runs on gloo too, so CPU tests run the code GPUs run."""
    group = process_group or dist.group.WORLD
    buf = bucket.buffer()
    compressed = buf.to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(decompress)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_gather_object(obj) -> list:
    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if dist.is_available() and dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj
