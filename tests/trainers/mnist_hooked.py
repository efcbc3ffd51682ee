"""pytorch/examples' MNIST trainer, with runhealth attached.

    python mnist_hooked.py --epochs 2 --save-model

Written as ``mnist/main.py`` (pytorch/examples d0b7e37, the newest change to that file in the
77f55b9 snapshot) is, on purpose: argparse with its options and defaults (``--batch-size 64``,
``--test-batch-size 1000``, ``--epochs 14``, ``--lr 1.0``, ``--gamma 0.7``, ``--log-interval 10``,
``--save-model``); its ``Net`` (two convolutions, dropout, two linear layers, ``log_softmax``)
trained from scratch by ``Adadelta`` at ``lr`` with ``StepLR(step_size=1, gamma)`` stepped after
each epoch; ``train`` printing ``Train Epoch: ... Loss: ...`` every ``--log-interval`` batches and
``test`` evaluating each epoch; ``torch.save(model.state_dict(), "mnist_cnn.pt")``, a relative path
in the working directory. What differs, for a CPU test without torchvision or a network:
``datasets.MNIST`` is a synthetic digit set built here (``SyntheticDigits``: 28x28 images of ten
blurred class templates, each shifted by up to 2 pixels, plus noise, normalized with MNIST's
mean and deviation; ``--samples`` training images, 2,000 by default, and a quarter as many test images), drawn through a shuffled
``DataLoader`` behind the same ``train_loader``/``test_loader`` names; the model is saved after
every epoch (overwritten in place) instead of once at the end, so that a rollback has a target;
and it runs on the CPU with one thread.

runhealth is attached by the README's recipe, every added or changed line marked ``# runhealth``:
the hook once the optimizer and scheduler exist, ``rh.windows`` over the loader (one window per
update), ``rh.loss`` with the targets (one class per example), ``rh.grad_norm`` of a
``clip_grad_norm_`` that does not clip (``max_norm=inf``: the script clips nothing),
``rh.checkpoint_saved`` after each save, and ``handle_rollback`` after each epoch's training,
which needs the ``for`` over epochs made a ``while``. The example's checkpoint holds the weights
only, so the rollback's load also forgets Adadelta's running averages (a NaN update left them
NaN: kept, every update after the rollback would be NaN again), and runhealth calls that resume
broken (``optimizer_state_lost``); ``--save_optimizer`` saves ``{"model": ..., "optimizer": ...}``
instead, loaded back by ``load_state_dicts``, and the resume verifies. The test knobs: ``--nan_at=STEP`` (that
update's loss is NaN; updates counted from 1 over the whole run) and ``--x3_at=STEP`` (its loss
is tripled), each once per process, ``--step_sleep`` (seconds added to each update), ``--samples`` and
``--save_optimizer``.
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

from collectors import RunHealth, handle_rollback, load_state_dicts  # runhealth


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


class SyntheticDigits(torch.utils.data.Dataset):
    """Stands in for ``datasets.MNIST``: ``size`` images of 1x28x28 in 10 classes, each a blurred
    random stroke template of its class moved by up to 2 pixels, plus noise, clipped to [0, 1]
    and normalized as the example's transform does. The templates are the same for the
    training and the test set (``seed`` draws the samples)."""

    def __init__(self, size, seed):
        templates = _templates()
        rng = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, 10, (size,), generator=rng)
        shifts = torch.randint(-2, 3, (size, 2), generator=rng)
        images = torch.stack(
            [
                torch.roll(templates[t], tuple(s.tolist()), (1, 2))
                for t, s in zip(self.targets, shifts, strict=True)
            ]
        )
        images = (images + 0.3 * torch.randn(images.shape, generator=rng)).clamp(0.0, 1.0)
        self.data = (images - 0.1307) / 0.3081

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.data[index], int(self.targets[index])


def _templates():
    """Ten 1x28x28 templates: sparse random strokes in the central 20x20, blurred by a 5x5 box."""
    rng = torch.Generator().manual_seed(1234)
    strokes = torch.zeros(10, 1, 28, 28)
    strokes[:, :, 4:24, 4:24] = (torch.rand(10, 1, 20, 20, generator=rng) < 0.12).float()
    blurred = F.avg_pool2d(strokes, 5, stride=1, padding=2, count_include_pad=False)
    return blurred / blurred.amax(dim=(1, 2, 3), keepdim=True)


injected = set()  # the test's faults, each once per process


def train(args, model, device, train_loader, optimizer, epoch, rh):  # runhealth: rh
    model.train()
    for batch_idx, (data, target) in enumerate(rh.windows(train_loader)):  # runhealth: a window per update
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        step = (epoch - 1) * len(train_loader) + batch_idx + 1
        for at, factor in ((args.nan_at, math.nan), (args.x3_at, 3.0)):
            if step == at and at not in injected:
                loss = loss * factor
                injected.add(at)
        rh.loss(loss, labels=target)  # runhealth
        loss.backward()
        rh.grad_norm(
            torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
        )  # runhealth: the norm, no clip
        optimizer.step()
        time.sleep(args.step_sleep)
        if batch_idx % args.log_interval == 0:
            print(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)} ({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
            )
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)

    print(
        f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)} ({100.0 * correct / len(test_loader.dataset):.0f}%)\n"
    )


def main():
    # Training settings
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument(
        "--batch-size", type=int, default=64, metavar="N", help="input batch size for training (default: 64)"
    )
    parser.add_argument(
        "--test-batch-size",
        type=int,
        default=1000,
        metavar="N",
        help="input batch size for testing (default: 1000)",
    )
    parser.add_argument(
        "--epochs", type=int, default=14, metavar="N", help="number of epochs to train (default: 14)"
    )
    parser.add_argument("--lr", type=float, default=1.0, metavar="LR", help="learning rate (default: 1.0)")
    parser.add_argument(
        "--gamma", type=float, default=0.7, metavar="M", help="Learning rate step gamma (default: 0.7)"
    )
    parser.add_argument("--no-accel", action="store_true", help="disables accelerator")
    parser.add_argument("--dry-run", action="store_true", help="quickly check a single pass")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (default: 1)")
    parser.add_argument(
        "--log-interval",
        type=int,
        default=10,
        metavar="N",
        help="how many batches to wait before logging training status",
    )
    parser.add_argument("--save-model", action="store_true", help="For Saving the current Model")
    parser.add_argument("--nan_at", type=int, default=-1)  # the test's knobs
    parser.add_argument("--x3_at", type=int, default=-1)
    parser.add_argument("--step_sleep", type=float, default=0.0)
    parser.add_argument("--save_optimizer", action="store_true")  # a resumable checkpoint
    parser.add_argument("--samples", type=int, default=2000)  # synthetic training images; test: a quarter
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    device = torch.device("cpu")  # the test runs on the CPU; the example picks an accelerator

    train_kwargs = {"batch_size": args.batch_size, "shuffle": True}  # shuffled, as with an accelerator
    test_kwargs = {"batch_size": args.test_batch_size}

    dataset1 = SyntheticDigits(args.samples, seed=args.seed)  # was datasets.MNIST(train=True)
    dataset2 = SyntheticDigits(args.samples // 4, seed=args.seed + 1000)  # was datasets.MNIST(train=False)
    train_loader = torch.utils.data.DataLoader(dataset1, **train_kwargs)
    test_loader = torch.utils.data.DataLoader(dataset2, **test_kwargs)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    rh = RunHealth(model=model, optimizer=optimizer, scheduler=scheduler).start()  # runhealth: closed at exit

    def load_weights(path):  # runhealth: the rollback's load
        model.load_state_dict(torch.load(path))  # runhealth
        optimizer.state.clear()  # runhealth: Adadelta's averages are not in the file

    load = load_state_dicts(model=model, optimizer=optimizer) if args.save_optimizer else load_weights

    epoch = 1  # runhealth
    while epoch <= args.epochs:  # runhealth: was for epoch in range(1, args.epochs + 1)
        train(args, model, device, train_loader, optimizer, epoch, rh)  # runhealth: rh
        if (rollback := handle_rollback(rh, load)) is not None:  # runhealth
            epoch = rollback.checkpoint_step // len(train_loader) + 1  # runhealth: the next epoch
            continue  # runhealth
        test(model, device, test_loader)
        scheduler.step()
        if args.save_model:  # every epoch, so that a rollback has a target
            if args.save_optimizer:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "mnist_cnn.pt")
            else:
                torch.save(model.state_dict(), "mnist_cnn.pt")
            rh.checkpoint_saved(epoch * len(train_loader), "mnist_cnn.pt")  # runhealth
        epoch += 1  # runhealth


if __name__ == "__main__":
    main()
