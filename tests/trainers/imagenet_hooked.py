"""pytorch/examples' ImageNet trainer, small, with runhealth attached.

    torchrun --standalone --nproc_per_node=4 imagenet_hooked.py --dist-url env:// \\
        --dist-backend gloo --epochs 6

Written as ``imagenet/main.py`` (pytorch/examples 4206858, the newest change to that file in the
77f55b9 snapshot) is, on purpose: argparse with its options and defaults (``--lr 0.1``,
``--momentum 0.9``, ``--wd 1e-4``, ``--resume PATH``, ``--dist-url``, ``--world-size``,
``--rank``, ``--multiprocessing-distributed`` through ``mp.spawn``); ``main_worker`` joining the
process group by ``init_method``; SGD with momentum and a ``StepLR(step_size=30)`` stepped after
each epoch; a ``DistributedSampler`` with ``set_epoch``; ``train`` over the loader with
``AverageMeter``/``ProgressMeter`` and ``accuracy`` (each batch's ``loss.item()``); ``validate``
all-reducing its meters across ranks; rank 0 saving ``checkpoint.pth.tar`` every epoch (a relative
path, overwritten) and copying it to ``model_best.pth.tar`` when accuracy improved; ``--resume``
restoring model, optimizer, scheduler, epoch and best accuracy. What differs, for a CPU test:
``ImageFolder`` is a synthetic learnable set of 3x8x8 images in 10 classes (the same on every
rank), the model a small CNN instead of ``models.__dict__[arch]``, and on the CPU the model is
wrapped in ``DistributedDataParallel`` as the original does on a GPU (on the CPU the original
trains an unsynchronized model per rank).

runhealth is attached by the README's recipe, every added or changed line marked ``+``: the hook
after the optimizer and scheduler exist, ``rh.windows`` over the loader, ``rh.loss`` with the
targets (one class per example), ``rh.grad_norm`` of a ``clip_grad_norm_`` that does not clip
(``max_norm=inf``: the script clips nothing), ``rh.checkpoint_saved`` for each file
``save_checkpoint`` writes, ``rh.resumed`` after ``--resume`` (once the loader's length gives the
step), and ``handle_rollback`` after each epoch's training; the restore moved into a function
both use, and the ``for`` over epochs made a ``while``. The test knobs: ``--nan-at=STEP`` (rank
``--nan-rank``'s loss at that update is NaN, once per process) and ``--step-sleep``.
"""

import argparse
import math
import os
import random
import shutil
import time
import warnings
from enum import Enum

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.parallel
import torch.optim
import torch.utils.data
import torch.utils.data.distributed
from torch.optim.lr_scheduler import StepLR

from collectors import RunHealth, handle_rollback  # +

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument(
    "data", metavar="DIR", nargs="?", default="imagenet", help="path to dataset (default: imagenet)"
)
parser.add_argument(
    "-j", "--workers", default=0, type=int, metavar="N", help="number of data loading workers"
)
parser.add_argument("--epochs", default=90, type=int, metavar="N", help="number of total epochs to run")
parser.add_argument(
    "--start-epoch", default=0, type=int, metavar="N", help="manual epoch number (useful on restarts)"
)
parser.add_argument("-b", "--batch-size", default=32, type=int, metavar="N", help="mini-batch size")
parser.add_argument(
    "--lr", "--learning-rate", default=0.1, type=float, metavar="LR", help="initial learning rate", dest="lr"
)
parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, metavar="W", dest="weight_decay")
parser.add_argument(
    "-p", "--print-freq", default=10, type=int, metavar="N", help="print frequency (default: 10)"
)
parser.add_argument(
    "--resume", default="", type=str, metavar="PATH", help="path to latest checkpoint (default: none)"
)
parser.add_argument("--world-size", default=-1, type=int, help="number of nodes for distributed training")
parser.add_argument("--rank", default=-1, type=int, help="node rank for distributed training")
parser.add_argument(
    "--dist-url", default="tcp://224.66.41.62:23456", type=str, help="url used to set up distributed training"
)
parser.add_argument("--dist-backend", default="nccl", type=str, help="distributed backend")
parser.add_argument("--seed", default=None, type=int, help="seed for initializing training. ")
parser.add_argument("--multiprocessing-distributed", action="store_true", help="N processes per node")
parser.add_argument("--nan-at", default=-1, type=int)  # the test's knobs
parser.add_argument("--nan-rank", default=1, type=int)
parser.add_argument("--step-sleep", default=0.0, type=float)

best_acc1 = 0
CLASSES = 10


class SyntheticImages(torch.utils.data.Dataset):
    """``ImageFolder``'s stand-in: ``size`` 3x8x8 images, each its class's fixed pattern plus
    noise (learnable), the same on every rank and every start."""

    def __init__(self, size, seed):
        generator = torch.Generator().manual_seed(seed)
        prototypes = torch.randn(CLASSES, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        self.targets = torch.randint(0, CLASSES, (size,), generator=generator)
        self.images = prototypes[self.targets] + 1.5 * torch.randn(size, 3, 8, 8, generator=generator)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.images[index], self.targets[index]


def small_cnn():
    torch.manual_seed(0)  # the same initial weights on every rank, as DDP expects
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, CLASSES),
    )  # fmt: skip


def main():
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        warnings.warn("You have chosen to seed training.", stacklevel=1)

    if args.dist_url == "env://" and args.world_size == -1:
        args.world_size = int(os.environ["WORLD_SIZE"])

    args.distributed = args.world_size > 1 or args.multiprocessing_distributed
    ngpus_per_node = 1  # the CPU

    if args.multiprocessing_distributed:
        args.world_size = ngpus_per_node * args.world_size
        mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))
    else:
        main_worker(None, ngpus_per_node, args)


def main_worker(gpu, ngpus_per_node, args):
    global best_acc1
    args.gpu = gpu
    torch.set_num_threads(1)
    device = torch.device("cpu")

    if args.distributed:
        if args.dist_url == "env://" and args.rank == -1:
            args.rank = int(os.environ["RANK"])
        if args.multiprocessing_distributed:
            args.rank = args.rank * ngpus_per_node + gpu
        dist.init_process_group(
            backend=args.dist_backend, init_method=args.dist_url, world_size=args.world_size, rank=args.rank
        )
    print("=> creating model 'small_cnn'")
    model = small_cnn()
    model.to(device)
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)

    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scheduler = StepLR(optimizer, step_size=30, gamma=0.1)
    rh = RunHealth(model=model, optimizer=optimizer, scheduler=scheduler).start()  # + closed at exit

    def load_checkpoint(path):  # + the --resume block, a function: the rollback's load too
        global best_acc1
        print(f"=> loading checkpoint '{path}'")
        checkpoint = torch.load(path)
        args.start_epoch = checkpoint["epoch"]
        best_acc1 = checkpoint["best_acc1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        print(f"=> loaded checkpoint '{path}' (epoch {checkpoint['epoch']})")
        return checkpoint["epoch"]  # +

    if args.resume:
        if os.path.isfile(args.resume):
            load_checkpoint(args.resume)
        else:
            print(f"=> no checkpoint found at '{args.resume}'")

    train_dataset = SyntheticImages(1024, seed=1)
    val_dataset = SyntheticImages(256, seed=2)

    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(
            val_dataset, shuffle=False, drop_last=True
        )
    else:
        train_sampler = None
        val_sampler = None

    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, sampler=train_sampler,
    )  # fmt: skip
    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers, sampler=val_sampler
    )
    if args.resume and os.path.isfile(args.resume):  # +
        rh.resumed(checkpoint_path=args.resume, checkpoint_step=args.start_epoch * len(train_loader))  # +

    epoch = args.start_epoch  # +
    while epoch < args.epochs:  # + was: for epoch in range(args.start_epoch, args.epochs)
        if args.distributed:
            train_sampler.set_epoch(epoch)

        train(train_loader, model, criterion, optimizer, epoch, device, args, rh)
        if (rollback := handle_rollback(rh, load_checkpoint)) is not None:  # + every rank
            epoch = rollback.loaded  # + the epoch after the saved one
            continue  # +

        acc1 = validate(val_loader, model, criterion, args)

        scheduler.step()

        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)

        if not args.multiprocessing_distributed or (
            args.multiprocessing_distributed and args.rank % ngpus_per_node == 0
        ):  # under torchrun (env://) every rank saves, over the same file
            save_checkpoint(
                {
                    "epoch": epoch + 1,
                    "arch": "small_cnn",
                    "state_dict": model.state_dict(),
                    "best_acc1": best_acc1,
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                },
                is_best,
                rh,  # +
                (epoch + 1) * len(train_loader),  # + the step it holds
            )
        epoch += 1  # +


def train(train_loader, model, criterion, optimizer, epoch, device, args, rh):
    batch_time = AverageMeter("Time", ":6.3f", Summary.NONE)
    data_time = AverageMeter("Data", ":6.3f", Summary.NONE)
    losses = AverageMeter("Loss", ":.4e", Summary.NONE)
    top1 = AverageMeter("Acc@1", ":6.2f", Summary.NONE)
    top5 = AverageMeter("Acc@5", ":6.2f", Summary.NONE)
    progress = ProgressMeter(
        len(train_loader), [batch_time, data_time, losses, top1, top5], prefix=f"Epoch: [{epoch}]"
    )

    model.train()

    end = time.time()
    for i, (images, target) in enumerate(rh.windows(train_loader)):  # + a window per update
        data_time.update(time.time() - end)

        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)

        output = model(images)
        loss = criterion(output, target)
        step = epoch * len(train_loader) + i + 1
        if step == args.nan_at and args.rank == args.nan_rank and not getattr(args, "injected", False):
            loss, args.injected = loss * math.nan, True  # the test's fault
        rh.loss(loss, labels=target)  # +

        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0], images.size(0))
        top5.update(acc5[0], images.size(0))

        optimizer.zero_grad()
        loss.backward()
        rh.grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))  # + the norm, no clip
        optimizer.step()
        time.sleep(args.step_sleep)

        batch_time.update(time.time() - end)
        end = time.time()

        if i % args.print_freq == 0:
            progress.display(i + 1)


def validate(val_loader, model, criterion, args):
    def run_validate(loader, base_progress=0):
        with torch.no_grad():
            end = time.time()
            for i, (images, target) in enumerate(loader):
                i = base_progress + i
                output = model(images)
                loss = criterion(output, target)
                acc1, acc5 = accuracy(output, target, topk=(1, 5))
                losses.update(loss.item(), images.size(0))
                top1.update(acc1[0], images.size(0))
                top5.update(acc5[0], images.size(0))
                batch_time.update(time.time() - end)
                end = time.time()
                if i % args.print_freq == 0:
                    progress.display(i + 1)

    batch_time = AverageMeter("Time", ":6.3f", Summary.NONE)
    losses = AverageMeter("Loss", ":.4e", Summary.NONE)
    top1 = AverageMeter("Acc@1", ":6.2f", Summary.AVERAGE)
    top5 = AverageMeter("Acc@5", ":6.2f", Summary.AVERAGE)
    progress = ProgressMeter(len(val_loader), [batch_time, losses, top1, top5], prefix="Test: ")

    model.eval()
    run_validate(val_loader)
    if args.distributed:
        top1.all_reduce()
        top5.all_reduce()
    progress.display_summary()
    return top1.avg


def save_checkpoint(state, is_best, rh, step, filename="checkpoint.pth.tar"):  # + rh, step
    torch.save(state, filename)
    rh.checkpoint_saved(step, filename)  # +
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")
        rh.checkpoint_saved(step, "model_best.pth.tar")  # +


class Summary(Enum):
    NONE = 0
    AVERAGE = 1
    SUM = 2
    COUNT = 3


class AverageMeter:
    """Computes and stores the average and current value"""

    def __init__(self, name, fmt=":f", summary_type=Summary.AVERAGE):
        self.name = name
        self.fmt = fmt
        self.summary_type = summary_type
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self):
        total = torch.tensor([self.sum, self.count], dtype=torch.float32)
        dist.all_reduce(total, dist.ReduceOp.SUM, async_op=False)
        self.sum, self.count = total.tolist()
        self.avg = self.sum / self.count

    def __str__(self):
        fmtstr = "{name} {val" + self.fmt + "} ({avg" + self.fmt + "})"
        return fmtstr.format(**self.__dict__)

    def summary(self):
        if self.summary_type is Summary.NONE:
            return ""
        return "{name} {avg:.3f}".format(**self.__dict__)


class ProgressMeter:
    def __init__(self, num_batches, meters, prefix=""):
        self.batch_fmtstr = self._get_batch_fmtstr(num_batches)
        self.meters = meters
        self.prefix = prefix

    def display(self, batch):
        entries = [self.prefix + self.batch_fmtstr.format(batch)]
        entries += [str(meter) for meter in self.meters]
        print("\t".join(entries))

    def display_summary(self):
        entries = [" *"]
        entries += [meter.summary() for meter in self.meters]
        print(" ".join(entries))

    def _get_batch_fmtstr(self, num_batches):
        num_digits = len(str(num_batches // 1))
        fmt = "{:" + str(num_digits) + "d}"
        return "[" + fmt + "/" + fmt.format(num_batches) + "]"


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


if __name__ == "__main__":
    main()
