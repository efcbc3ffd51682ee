"""An Accelerate custom training loop written as Hugging Face's own examples are, with runhealth
attached: ``accelerate/examples/complete_nlp_example.py`` and ``by_feature/checkpointing.py``.

    torchrun --nproc_per_node 2 accelerate_hooked.py --checkpointing_steps 10
    torchrun --nproc_per_node 2 accelerate_hooked.py --resume_from_checkpoint step_20

(``accelerate launch --multi_gpu --num_processes 2`` does the same on a CPU-only host;
``--cpu`` would start one process.)

An ``Accelerator`` with gradient accumulation; ``accelerator.prepare(model, optimizer,
train_dataloader, lr_scheduler)``; ``with accelerator.accumulate(model)``, ``accelerator.backward``,
``accelerator.clip_grad_norm_`` on the updating microbatch (``accelerator.sync_gradients``);
``accelerator.save_state(f"step_{completed_steps}")`` every ``--checkpointing_steps`` updates,
relative to the working directory; ``--resume_from_checkpoint step_N``: ``accelerator.load_state``,
the epoch and the batches into it from the folder's name, ``accelerator.skip_first_batches`` for
the rest of that epoch. A tiny GPT-2 built from its config (no download) on a token stream made
from a seed (each token mostly follows from the one before, so the loss falls). The training
sampler is seeded (``use_seedable_sampler``) so a checkpoint is followed by the same batches
every time, which the resume declares (``deterministic_data=True``).

The runhealth lines are marked ``# +``. The test knobs: ``--step_sleep`` (seconds added to each update), ``--save_sleep`` (to each save), ``--nan_at`` (rank ``--nan_rank``'s loss
at that update is NaN, once per process) and ``--forget_skip`` (the resume restores the state
but does not skip the batches the checkpoint had consumed: its epoch starts again from its first
batch).
"""

import argparse
import math
import os
import time

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from collectors import RunHealth, handle_rollback  # +


class TokenStream(Dataset):
    """``size`` sequences of ``length`` tokens from one seeded stream; each item names its index."""

    def __init__(self, size: int, length: int, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        successor = torch.randperm(vocab, generator=generator)
        stream = torch.empty(size * length, dtype=torch.long)
        stream[0] = 0
        noise = torch.rand(len(stream), generator=generator) < 0.1
        random_tokens = torch.randint(vocab, (len(stream),), generator=generator)
        for index in range(1, len(stream)):
            stream[index] = random_tokens[index] if noise[index] else successor[stream[index - 1]]
        self.sequences = stream.view(size, length)

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.sequences[index]
        return {"input_ids": tokens, "labels": tokens, "ids": torch.tensor(index)}


def training_function(args: argparse.Namespace) -> None:
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    torch.set_num_threads(1)
    set_seed(args.seed)
    dataset = TokenStream(args.dataset_size, args.block_size, args.vocab_size, args.seed)
    train_dataloader = DataLoader(dataset, shuffle=True, batch_size=args.per_device_train_batch_size)
    config = GPT2Config(
        vocab_size=args.vocab_size, n_positions=args.block_size, n_embd=32, n_layer=2, n_head=2
    )
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    # As transformers' run_clm_no_trainer.py: the prepared scheduler steps once per process.
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer,
        num_warmup_steps=10 * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    rh = RunHealth(model=model, optimizer=optimizer, scheduler=lr_scheduler).start()  # +
    updates_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)

    def load(path: str) -> int:
        """Restore a ``step_N`` folder; the updates it had made, from its name."""
        accelerator.load_state(path)
        return int(os.path.basename(os.path.normpath(path)).replace("step_", ""))

    total_batch_size = (
        args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    )
    completed_steps = 0
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        completed_steps = load(args.resume_from_checkpoint)
        rh.resumed(
            checkpoint_path=args.resume_from_checkpoint,
            checkpoint_step=completed_steps,
            consumed=completed_steps * total_batch_size,
            deterministic_data=True,
        )  # +
    resumed = completed_steps > 0
    injected = False
    while completed_steps < args.max_train_steps:
        starting_epoch, resume_batches = divmod(completed_steps, updates_per_epoch)
        resume_batches *= args.gradient_accumulation_steps
        for epoch in range(starting_epoch, math.ceil(args.max_train_steps / updates_per_epoch)):
            model.train()
            train_dataloader.set_epoch(epoch)
            if resumed and epoch == starting_epoch and resume_batches and not args.forget_skip:
                active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_batches)
            else:
                active_dataloader = train_dataloader
            for batch in rh.windows(
                active_dataloader,
                sample_ids=lambda b: b["ids"],
                microbatches=args.gradient_accumulation_steps,
            ):  # +
                with accelerator.accumulate(model):
                    outputs = model(input_ids=batch["input_ids"], labels=batch["labels"])
                    loss = outputs.loss
                    if (
                        completed_steps + 1 == args.nan_at
                        and accelerator.process_index == args.nan_rank
                        and not injected
                    ):
                        loss, injected = loss * math.nan, True  # the test's fault
                    rh.loss(loss, labels=batch["labels"])  # +
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        rh.grad_norm(accelerator.clip_grad_norm_(model.parameters(), 1.0))  # + (wrapped)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:
                    time.sleep(args.step_sleep)  # the test's pacing
                    completed_steps += 1
                    if completed_steps % args.checkpointing_steps == 0:
                        output_dir = f"step_{completed_steps}"
                        rh.checkpoint_saving()  # + a save's timeout for the hang rule, not a step's
                        accelerator.save_state(output_dir)
                        time.sleep(args.save_sleep)  # the test's slow storage
                        rh.checkpoint_saved(completed_steps, output_dir)  # +
                    if completed_steps % 10 == 0:
                        accelerator.print(f"step {completed_steps}: loss {loss.item():.4f}")
                if completed_steps >= args.max_train_steps:
                    break
            if completed_steps >= args.max_train_steps or rh.should_stop():  # +
                break
        if (
            rollback := handle_rollback(rh, load, resume=lambda _: {"deterministic_data": True})
        ) is not None:  # +
            completed_steps, resumed = rollback.loaded, True  # +
        elif completed_steps < args.max_train_steps:
            break
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description="A tiny GPT-2 under Accelerate, with runhealth.")
    parser.add_argument("--checkpointing_steps", type=int, default=10)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    parser.add_argument("--max_train_steps", type=int, default=40)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--dataset_size", type=int, default=320)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--vocab_size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--nan_at", type=int, default=-1)
    parser.add_argument("--nan_rank", type=int, default=1)
    parser.add_argument("--forget_skip", action="store_true")
    parser.add_argument("--step_sleep", type=float, default=0.0)
    parser.add_argument("--save_sleep", type=float, default=0.0)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
