"""A stand-in for build-nanogpt's train_gpt2.py, of the same form, written here: a script whose module-level
settings (total_batch_size, B, T, use_compile, max_steps, enc) the reference harness replaces, that reads
`edu_fineweb10B/*{train,val}*.npy` from its working directory, trains the plain GPT of
benchmarks/bench_train.py (BaseGPT: no guards, no checkpoints) with fused AdamW, bf16 autocast on CUDA and
gradient accumulation, and prints one `step N | loss: L | ... | dt: D ms | tok/sec: R` line per step.

gpu_check's reference row runs it on CPU and in CI, so the row's machinery (launch, data, parsing, ratios)
is tested without the real file, whose code stays out of this repository (benchmarks/reference_run.py).
Single process only (the real file's DDP path needs CUDA and NCCL).
"""

import os
import time

import numpy as np
import tiktoken
import torch

from benchmarks.bench_train import BaseGPT
from gptcore.config import ModelConfig

total_batch_size = 4096
B = 4
T = 64
use_compile = False
max_steps = 8
n_layer = 2  # the stand-in's own model knobs (the real file's model is GPT-2 124M)
n_head = 2
n_embd = 64
enc = tiktoken.get_encoding("gpt2")  # as the real file does at import; the harness supplies it offline

device = "cuda" if torch.cuda.is_available() else "cpu"
assert total_batch_size % (B * T) == 0, "total_batch_size must be a multiple of B * T"
grad_accum_steps = total_batch_size // (B * T)


class ShardStream:
    """Consecutive (B, T) batches through the split's .npy shards, in name order, wrapping around."""

    def __init__(self, split: str):
        folder = "edu_fineweb10B"
        self.paths = sorted(os.path.join(folder, n) for n in os.listdir(folder) if split in n)
        assert self.paths, f"no {split} shards in {folder}"
        self.shard, self.pos = 0, 0
        self.tokens = self.load()

    def load(self) -> torch.Tensor:
        return torch.from_numpy(np.load(self.paths[self.shard]).astype(np.int64))

    def next_batch(self):
        buf = self.tokens[self.pos:self.pos + B * T + 1]
        self.pos += B * T
        if self.pos + B * T + 1 > len(self.tokens):
            self.shard, self.pos = (self.shard + 1) % len(self.paths), 0
            self.tokens = self.load()
        return buf[:-1].view(B, T).to(device), buf[1:].view(B, T).to(device)


torch.manual_seed(1337)
model = BaseGPT(ModelConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=T)).to(device)
raw_model = model
if use_compile:
    model = torch.compile(model)
decay = [p for p in raw_model.parameters() if p.dim() >= 2]
other = [p for p in raw_model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                              lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")
train = ShardStream("train")
autocast_dtype = torch.bfloat16 if device == "cuda" else torch.float32
for step in range(max_steps):
    t0 = time.time()
    optimizer.zero_grad(set_to_none=True)
    loss_accum = 0.0
    for _ in range(grad_accum_steps):
        x, y = train.next_batch()
        with torch.autocast(device_type=device, dtype=autocast_dtype, enabled=device == "cuda"):
            loss = model(x, y) / grad_accum_steps
        loss_accum += loss.detach()
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.time() - t0
    print(f"step {step:5d} | loss: {loss_accum.item():.6f} | norm: {norm:.4f} | dt: {dt * 1000:.2f}ms | "
          f"tok/sec: {total_batch_size / dt:.2f}", flush=True)
