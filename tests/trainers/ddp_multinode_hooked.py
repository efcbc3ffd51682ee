"""PyTorch's DDP tutorial series multi-node trainer, with runhealth attached.

    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --max-restarts=3 ddp_multinode_hooked.py 10 1

Written as ``examples/distributed/ddp-tutorial-series/multinode.py`` (pytorch/examples) is, on
purpose: a ``Trainer`` class that loads ``snapshot.pt`` (a relative path, in the working
directory) in its constructor when the file exists, runs epochs over a ``DataLoader`` with a
``DistributedSampler`` (``set_epoch`` each epoch), and has global rank 0 save one snapshot,
overwritten in place, every ``save_every`` epochs; a crash is left to torchrun's
``--max-restarts``, which starts the whole group again from that file. On the CPU, gloo, one
thread per rank. Two changes from the tutorial, both for a run that can be judged: the dataset
is a learnable 4-class problem (the tutorial's 1-output ``cross_entropy`` is 0 at every step),
and ``EPOCHS_RUN`` is the number of epochs done (the tutorial stores the epoch's index, so a
resume trains the saved epoch again).

runhealth is attached by the README's recipes, every added line marked ``+``: the hook around
the training (``with RunHealth(...)``), ``rh.windows`` over the loader, ``rh.loss`` and
``rh.grad_norm``, ``rh.checkpoint_saved`` after the save, ``rh.resumed`` after the load, and
``handle_rollback`` between epochs. The test knobs: ``--crash_at=STEP`` (rank ``--crash_rank``
raises before that global step's update, in the job's first start only: torchrun restarts
the group), ``--nan_at=STEP`` (rank ``--nan_rank``'s loss is NaN at that step, once per
process) and ``--step_sleep`` (seconds added to each step).
"""

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from collectors import RunHealth, handle_rollback  # +

CLASSES = 4


class MyTrainDataset(Dataset):
    """``size`` examples of 20 features, labelled by a fixed linear map: learnable, the same on
    every rank and every start."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randn(size, 20, generator=generator)
        self.labels = (self.data @ torch.randn(20, CLASSES, generator=generator)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index], self.labels[index]


def ddp_setup():
    torch.set_num_threads(1)
    init_process_group(backend="gloo")
    return torch.device("cpu")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device, rh, args) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.device = device
        self.rh = rh
        self.args = args
        self.injected = False
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
            rh.resumed(checkpoint_path=snapshot_path, checkpoint_step=self._steps(self.epochs_run))  # +
        self.model = DDP(self.model)

    def _steps(self, epochs: int) -> int:
        """Optimizer steps in ``epochs`` whole epochs: the step a snapshot is saved at."""
        return epochs * len(self.train_data)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=str(self.device))
        model = self.model.module if isinstance(self.model, DDP) else self.model
        model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")
        return self.epochs_run

    def _run_batch(self, source, targets, step):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        if step == self.args.nan_at and self.global_rank == self.args.nan_rank and not self.injected:
            loss, self.injected = loss * math.nan, True  # the test's fault
        self.rh.loss(loss, labels=targets)  # +
        loss.backward()
        self.rh.grad_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))  # +
        if step == self.args.crash_at and self.global_rank == self.args.crash_rank and first_start():
            raise RuntimeError(f"rank {self.global_rank} crashed at step {step} (--crash_at)")
        self.optimizer.step()
        time.sleep(self.args.step_sleep)

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        step = self._steps(epoch)
        for source, targets in self.rh.windows(self.train_data):  # + ends at a rollback's stop
            source = source.to(self.device)
            targets = targets.to(self.device)
            step += 1
            self._run_batch(source, targets, step)

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        torch.save(snapshot, self.snapshot_path)
        self.rh.checkpoint_saved(self._steps(epoch + 1), self.snapshot_path)  # +
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        epoch = self.epochs_run
        while epoch < max_epochs:
            self._run_epoch(epoch)
            if (rollback := handle_rollback(self.rh, self._load_snapshot)) is not None:  # +
                epoch = rollback.loaded  # +
                continue  # +
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            epoch += 1


def first_start() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def load_train_objs(dataset_size):
    train_set = MyTrainDataset(dataset_size)
    torch.manual_seed(0)  # the same initial weights on every rank, as DDP expects
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(
        dataset, batch_size=batch_size, pin_memory=False, shuffle=False, sampler=DistributedSampler(dataset)
    )


def main(args, snapshot_path: str = "snapshot.pt"):
    device = ddp_setup()
    dataset, model, optimizer = load_train_objs(args.dataset_size)
    train_data = prepare_dataloader(dataset, args.batch_size)
    with RunHealth(model=model, optimizer=optimizer) as rh:  # +
        trainer = Trainer(model, train_data, optimizer, args.save_every, snapshot_path, device, rh, args)
        trainer.train(args.total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument(
        "--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)"
    )
    parser.add_argument("--dataset_size", default=2048, type=int)
    parser.add_argument("--step_sleep", default=0.0, type=float)
    parser.add_argument("--crash_at", default=-1, type=int)
    parser.add_argument("--crash_rank", default=3, type=int)
    parser.add_argument("--nan_at", default=-1, type=int)
    parser.add_argument("--nan_rank", default=1, type=int)
    main(parser.parse_args())
