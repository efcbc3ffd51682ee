"""A Lightning module with manual optimization, without runhealth: the baseline of the attach count.

    python lightning_plain.py --data_dir=data --max_steps=12

Written the way manual-optimization modules are (GANs, multiple optimizers, custom accumulation):
``automatic_optimization = False``, ``self.manual_backward`` and ``self.clip_gradients`` in
``training_step``, which returns the loss; a small GPT-style model, a ``Dataset`` of fixed
blocks of a uint16 token file. ``lightning_hooked.py`` is this file with the README's callback
line added.
"""

import argparse

import lightning
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class TokenBlocks(Dataset):
    """Consecutive blocks of a token file: inputs and the targets one token later."""

    def __init__(self, path, block_size):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index):
        start = index * self.block_size
        ids = torch.from_numpy(self.data[start : start + self.block_size + 1].astype(np.int64))
        return {"input_ids": ids[:-1], "labels": ids[1:]}


class TinyLM(lightning.LightningModule):
    def __init__(self, vocab_size=64, width=32):
        super().__init__()
        self.automatic_optimization = False
        self.embed = nn.Embedding(vocab_size, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=4 * width, batch_first=True)
        self.body = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1))
        return self.head(self.body(self.embed(ids), mask=mask, is_causal=True))

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        optimizer.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", default="data")
    parser.add_argument("--max_steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loader = DataLoader(TokenBlocks(f"{args.data_dir}/train.bin", 32), batch_size=4, shuffle=True)
    trainer = lightning.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLM(), loader)


if __name__ == "__main__":
    main()
