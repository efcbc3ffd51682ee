"""A nanoGPT-style single-file GPT trainer, without runhealth: the baseline of the attach count.

    torchrun --nproc_per_node=4 nanogpt_plain.py --data_dir=data --max_iters=200
    torchrun --nproc_per_node=4 nanogpt_plain.py --data_dir=data --init_from=resume

Written the way popular single-file training scripts are, on purpose: configuration as module
globals overridden by ``--key=value``; a ``while True`` loop; batches drawn at random offsets of
a token file (``np.memmap`` of uint16, opened anew per batch); gradient accumulation with the
loss divided by the number of microbatches; one checkpoint file, ``out/ckpt.pt`` under a
relative output directory, overwritten by rank 0 at every evaluation; resume with
``--init_from=resume``; the global RNG seeded at start, so the batches after a resume are new
draws. DDP on gloo, on the CPU, one thread per rank.

``nanogpt_hooked.py`` is this file with runhealth attached (``scripts/attach_lines.py`` counts
the lines that differ). The test knobs are in both alike: ``nan_at`` (rank ``nan_rank``'s loss
at that iteration is NaN, once per process), ``corrupt_at`` (rank ``corrupt_rank``'s
first microbatch at that iteration is random tokens, once per process: a corrupted shard), ``iter_sleep`` (seconds added to
each step), ``crash_at`` (the process raises after that iteration's update),
``resume_fault``, what a faulty restore forgets: ``weights``, ``optimizer`` (its state; the rate
is still set by the loop) or ``lr`` (the schedule's place: it restarts at this process's first
iteration), and ``stop_file``: the run ends after the first iteration that finds this file, every
rank at the same one (the test ends a run once what it checks has happened; ``max_iters`` is then
only a bound).
"""

import ast
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

# Configuration: every global below can be set as --key=value.
out_dir = "out"
data_dir = "data"
eval_interval = 20
eval_iters = 4
log_interval = 10
always_save_checkpoint = True
init_from = "scratch"  # or "resume": from out_dir/ckpt.pt
gradient_accumulation_steps = 2
batch_size = 4
block_size = 32
vocab_size = 64
n_layer = 2
n_head = 2
n_embd = 32
learning_rate = 3e-3
max_iters = 200
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
warmup_iters = 20
lr_decay_iters = 200
min_lr = 3e-4
seed = 1337
nan_at = -1
nan_rank = 1
corrupt_at = -1
corrupt_rank = 2
iter_sleep = 0.0
crash_at = -1  # the test's crash: this process raises at that iteration, before its step
resume_fault = ""  # the test's broken resumes: "weights", "optimizer" or "lr"
stop_file = ""  # the test's stop: the loop ends once this file exists
for arg in sys.argv[1:]:
    key, value = arg.removeprefix("--").split("=", 1)
    if key not in globals():
        raise SystemExit(f"unknown config key: {key}")
    try:
        globals()[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        globals()[key] = value  # a string


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
else:
    ddp_rank, ddp_world_size = 0, 1
master_process = ddp_rank == 0
torch.set_num_threads(1)
torch.manual_seed(seed + ddp_rank)
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    os.makedirs(out_dir, exist_ok=True)
ckpt_path = os.path.join(out_dir, "ckpt.pt")


def get_batch(split):
    # A new memmap for every batch, as nanoGPT does (a long-lived one grows in memory).
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


model = GPT()
raw_model = model
optimizer = torch.optim.AdamW(
    model.parameters(), lr=learning_rate, betas=(beta1, beta2), weight_decay=weight_decay
)


def load_checkpoint(path):
    """A checkpoint's model and optimizer state, into the live objects; its place in the run."""
    checkpoint = torch.load(path, map_location="cpu")
    if resume_fault != "weights":
        raw_model.load_state_dict(checkpoint["model"])
    if resume_fault != "optimizer":
        optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint["iter_num"], checkpoint["best_val_loss"]


iter_num, best_val_loss = 0, 1e9
if init_from == "resume":
    iter_num, best_val_loss = load_checkpoint(ckpt_path)
if ddp:
    # After the restore, as nanoGPT does: the constructor's broadcast is where every rank has
    # read ckpt.pt before rank 0 writes it again at its first evaluation.
    model = DDP(model)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def stop_requested():
    """Whether ``stop_file`` exists, agreed by every rank (one that stopped alone would leave the
    others waiting in their next all-reduce)."""
    flag = torch.tensor(float(os.path.exists(stop_file)))
    if ddp:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


X, Y = get_batch("train")
t0 = time.time()
local_iter_num = 0  # iterations in this process
injected = False
while True:
    lr = get_lr(local_iter_num if resume_fault == "lr" else iter_num)  # "lr": the schedule restarts
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                }
                torch.save(checkpoint, ckpt_path)
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        if iter_num == corrupt_at and ddp_rank == corrupt_rank and not injected:  # the test's fault
            X, Y, injected = torch.randint_like(X, vocab_size), torch.randint_like(Y, vocab_size), True
        logits, loss = model(X, Y)
        if iter_num == nan_at and ddp_rank == nan_rank and not injected:  # the test's fault
            loss, injected = loss * math.nan, True
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    time.sleep(iter_sleep)
    if iter_num == crash_at:  # the test's fault
        raise RuntimeError(f"crashed at iteration {iter_num} (--crash_at)")
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    local_iter_num += 1
    if iter_num > max_iters or (stop_file and stop_requested()):
        break

if ddp:
    destroy_process_group()
