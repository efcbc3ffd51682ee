"""A transformers ``Trainer`` subclass, without runhealth: the baseline of the attach count.

    HF_HUB_OFFLINE=1 python hf_plain.py --data_dir=data --output_dir=out-hf --max_steps=12
    HF_HUB_OFFLINE=1 torchrun --nproc_per_node=4 hf_plain.py --resume_from=out-hf/checkpoint-6

Written the way fine-tuning scripts subclass the Trainer: the model built from a config (nothing
downloaded), ``compute_loss`` overridden to add an auxiliary term to the model's own loss (a
z-loss on the logits, as PaLM trains with), a ``Dataset`` of fixed blocks of a uint16 token
file. ``hf_hooked.py`` is this file with the README's callback line added.
"""

import argparse

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from collectors.hf import RunHealthCallback


class TokenBlocks(Dataset):
    """Consecutive blocks of a token file; each block is its own labels (the model shifts)."""

    def __init__(self, path, block_size):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index):
        start = index * self.block_size
        ids = torch.from_numpy(self.data[start : start + self.block_size].astype(np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


class ZLossTrainer(Trainer):
    """The model's language-model loss plus a small z-loss that keeps the logits' scale down."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        z_loss = 1e-4 * torch.logsumexp(outputs.logits, dim=-1).pow(2).mean()
        loss = outputs.loss + z_loss
        return (loss, outputs) if return_outputs else loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", default="data")
    parser.add_argument("--output_dir", default="out-hf")
    parser.add_argument("--max_steps", type=int, default=12)
    parser.add_argument("--resume_from", default=None, help="a checkpoint folder to resume from")
    parser.add_argument(
        "--ignore_data_skip", action="store_true", help="resume without fast-forwarding the data"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        logging_steps=5,
        save_steps=6,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ignore_data_skip=args.ignore_data_skip,
    )
    trainer = ZLossTrainer(
        model=model, args=training, train_dataset=TokenBlocks(f"{args.data_dir}/train.bin", 32)
    )
    trainer.add_callback(RunHealthCallback(trainer))
    trainer.train(resume_from_checkpoint=args.resume_from)


if __name__ == "__main__":
    main()
