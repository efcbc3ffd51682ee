"""A litgpt-style Lightning Fabric pretraining script with runhealth attached by the README's
hand-written-loop recipe.

    python fabric_hooked.py --data_dir=data --devices=2 --max_iters=50
    python fabric_hooked.py --data_dir=data --devices=2 --max_iters=60 --resume=out/step-00000050

``--resume_fault=weights`` is the test's broken restore: everything but the model's weights.

Written the way litgpt's ``pretrain.py`` is, on purpose: Fabric launches its own processes
(``fabric.launch()`` re-runs this script for each further device: no ``torchrun``); a state dict
of model, optimizer and counters saved with ``fabric.save`` into a folder per step
(``out/step-00000025/lit_model.pth``, relative to the working directory) and restored with
``fabric.load``; batches drawn at random offsets of a uint16 token file; gradient accumulation
under ``fabric.no_backward_sync``, the loss divided by the number of microbatches before
``fabric.backward``; gradients clipped with ``fabric.clip_gradients``. DDP on gloo, on the CPU,
one thread per process.
"""

import argparse
import os
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from collectors import RunHealth

VOCAB = 64
BLOCK = 32


class TinyGPT(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(BLOCK, width)
        self.block = nn.TransformerEncoderLayer(width, 2, 4 * width, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        hidden = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        return self.head(self.block(hidden, src_mask=mask, is_causal=True))


def get_batch(
    data_dir: str, batch_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    offsets = torch.randint(len(data) - BLOCK, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i : i + BLOCK].astype(np.int64)) for i in offsets.tolist()])
    y = torch.stack(
        [torch.from_numpy(data[i + 1 : i + 1 + BLOCK].astype(np.int64)) for i in offsets.tolist()]
    )
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", default="data")
    parser.add_argument("--out_dir", default="out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max_iters", type=int, default=50)
    parser.add_argument("--save_interval", type=int, default=25)
    parser.add_argument("--micro_batches", type=int, default=2)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--resume_fault", choices=["weights"], default=None)  # restore all but the weights
    args = parser.parse_args()

    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy="ddp", precision="32-true")
    fabric.launch()
    fabric.seed_everything(1337)  # the same weights on every rank
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "iter_num": 0}
    generator = torch.Generator().manual_seed(1000 + fabric.global_rank)
    rh = RunHealth(model=model, optimizer=optimizer).start()
    if args.resume:
        restoring = {k: v for k, v in state.items() if args.resume_fault != "weights" or k != "model"}
        fabric.load(Path(args.resume) / "lit_model.pth", restoring, strict=False)
        state.update(restoring)
        rh.resumed(checkpoint_path=args.resume, checkpoint_step=state["iter_num"])
        generator.manual_seed(1000 + fabric.global_rank + state["iter_num"])

    while state["iter_num"] < args.max_iters:
        rh.window_start()
        for micro in range(args.micro_batches):
            x, y = get_batch(args.data_dir, 4, generator)
            with fabric.no_backward_sync(model, enabled=micro < args.micro_batches - 1):
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
                rh.loss(loss, labels=y)
                fabric.backward(loss / args.micro_batches)
        rh.grad_norm(fabric.clip_gradients(model, optimizer, max_norm=1.0))
        optimizer.step()
        optimizer.zero_grad()
        rh.window_end()
        state["iter_num"] += 1
        if state["iter_num"] % args.save_interval == 0:
            folder = Path(args.out_dir) / f"step-{state['iter_num']:08d}"
            fabric.save(folder / "lit_model.pth", state)  # rank 0 writes, every rank calls
            fabric.barrier()
            rh.checkpoint_saved(state["iter_num"], str(folder))
    rh.close()
    fabric.print(f"done at iteration {state['iter_num']}")


if __name__ == "__main__":
    main()
