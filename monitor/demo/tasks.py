"""The demo's training tasks: a model and a dataset whose batch ``i`` of rank ``r`` is the same
every time it is asked for, so a replay job sees exactly what the run saw.

- ``text``: a character-level transformer learning the Python standard library's own source
  (the json and email packages: real text that every Python installation carries).
- ``sequence``: a small MLP learning "each token is the previous plus one" with 10% label
  noise: learnable in a few dozen steps, for fast tests.

A corrupted batch is noise, as a damaged shard delivers it.
"""

from __future__ import annotations

import email
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn


class Task(Protocol):
    @property
    def vocab(self) -> int: ...

    def model(self) -> nn.Module: ...

    def batch(self, rank: int, index: int, corrupt: tuple[int, int] | None) -> dict[str, Any]: ...


def _seed(rank: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(rank * 1_000_003 + index)


@cache
def corpus() -> torch.Tensor:
    files = sorted(Path(json.__file__).parent.glob("*.py")) + sorted(Path(email.__file__).parent.glob("*.py"))
    text = "".join(path.read_text(encoding="utf-8", errors="replace") for path in files)
    return torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask: torch.Tensor = self.mask  # type: ignore[assignment]
        hidden = self.embed(tokens) + self.position[:n]
        return self.head(self.blocks(hidden, mask=mask[:n, :n], is_causal=True))  # type: ignore[no-any-return]


@dataclass(frozen=True)
class TextTask:
    vocab: int = 128
    length: int = 64
    rows: int = 8

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return TinyLM(self.vocab, width=64, layers=2, heads=4, length=self.length)

    def batch(self, rank: int, index: int, corrupt: tuple[int, int] | None) -> dict[str, Any]:
        data, generator = corpus(), _seed(rank, index)
        starts = torch.randint(0, len(data) - self.length - 1, (self.rows,), generator=generator)
        tokens = torch.stack([data[s : s + self.length + 1] for s in starts.tolist()])
        if corrupt == (rank, index):
            tokens = torch.randint(0, self.vocab, tokens.shape, generator=generator)
        return {"tokens": tokens, "index": index, "ids": [f"r{rank}-b{index}"]}


@dataclass(frozen=True)
class SequenceTask:
    vocab: int = 32
    length: int = 17
    rows: int = 8

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Embedding(self.vocab, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, self.vocab)
        )

    def batch(self, rank: int, index: int, corrupt: tuple[int, int] | None) -> dict[str, Any]:
        generator = _seed(rank, index)
        if corrupt == (rank, index):
            tokens = torch.randint(0, self.vocab, (self.rows, self.length), generator=generator)
        else:
            start = torch.randint(0, self.vocab, (self.rows, 1), generator=generator)
            tokens = (start + torch.arange(self.length)) % self.vocab
            noise = torch.rand(self.rows, self.length, generator=generator) < 0.1
            tokens = torch.where(
                noise, torch.randint(0, self.vocab, tokens.shape, generator=generator), tokens
            )
        return {"tokens": tokens, "index": index, "ids": [f"r{rank}-b{index}"]}


TASKS: dict[str, Task] = {"text": TextTask(), "sequence": SequenceTask()}


def loss_of(net: nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the batch's targets."""
    logits = net(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))


def pair(text: str | None) -> tuple[int, int] | None:
    """``"R:I"`` -> ``(R, I)``."""
    if text is None:
        return None
    rank, _, value = text.partition(":")
    return int(rank), int(value)
