"""``runhealth demo``: a small real training on the CPU, watched by runhealth end to end.

A character-level transformer learns from the Python standard library's own source text.
One batch is deliberately corrupted (its bytes replaced with noise, as a bad data shard
would be); every step is recorded through the ingest API into the embedded SQLite store,
and the demo ends with the incident the engine opened at that step.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from monitor import queries
from monitor.config import ServiceConfig
from monitor.server import BackgroundServer, prepare_store


@dataclass(frozen=True)
class DemoConfig:
    db: str | None = None
    steps: int = 300
    corrupt_step: int = 200
    seq_len: int = 64
    batch_size: int = 16
    send_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 60:
            raise ValueError("demo --steps must be at least 60 (50 steps of warm-up, then judging)")
        if not 50 < self.corrupt_step <= self.steps:
            raise ValueError(f"demo --corrupt-step must be in (50, {self.steps}]")


def corpus_text() -> str:
    """Real text that every Python installation carries: the json and email packages' source."""
    import email

    files = sorted(Path(json.__file__).parent.glob("*.py")) + sorted(Path(email.__file__).parent.glob("*.py"))
    return "".join(path.read_text(encoding="utf-8", errors="replace") for path in files)


class Trainer:
    """The small training job: model, optimizer, data, one step at a time."""

    def __init__(self, config: DemoConfig) -> None:
        import torch

        torch.manual_seed(config.seed)
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        self.torch = torch
        self.config = config
        text = corpus_text()
        self.data = torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)
        self.model = _tiny_lm(vocab=128, width=64, layers=2, heads=4, seq_len=config.seq_len)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / 20)
        )
        self.generator = torch.Generator().manual_seed(config.seed)

    def batch(self, step: int) -> tuple[Any, Any, list[int]]:
        torch = self.torch
        starts = torch.randint(
            0,
            len(self.data) - self.config.seq_len - 1,
            (self.config.batch_size,),
            generator=self.generator,
        )
        rows = torch.stack([self.data[s : s + self.config.seq_len + 1] for s in starts.tolist()])
        if step == self.config.corrupt_step:
            # The corrupted batch: bytes replaced with noise, as a damaged shard delivers them.
            rows = torch.randint(0, 128, rows.shape, generator=self.generator)
        return rows[:, :-1], rows[:, 1:], [int(s) for s in starts]

    def step(self, step: int) -> dict[str, Any]:
        torch = self.torch
        t0 = time.perf_counter()
        inputs, labels, sample_ids = self.batch(step)
        t1 = time.perf_counter()
        logits = self.model(inputs)
        loss_sum = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
        )
        tokens = labels.numel()
        t2 = time.perf_counter()
        (loss_sum / tokens).backward()
        t3 = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        lr = self.schedule.get_last_lr()[0]
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        return {
            "loss_sum": float(loss_sum.detach()),
            "tokens": tokens,
            "reported_loss": float(loss_sum.detach()) / tokens,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "sample_ids": sample_ids,
            "data_wait_s": t1 - t0,
            "forward_s": t2 - t1,
            "backward_s": t3 - t2,
            "optimizer_s": t4 - t3,
        }


def _tiny_lm(vocab: int, width: int, layers: int, heads: int, seq_len: int) -> Any:
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.position = nn.Parameter(torch.zeros(seq_len, width))
            layer = nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            n = tokens.shape[1]
            mask: torch.Tensor = self.mask  # type: ignore[assignment]
            hidden = self.embed(tokens) + self.position[:n]
            hidden = self.blocks(hidden, mask=mask[:n, :n], is_causal=True)
            return self.head(hidden)  # type: ignore[no-any-return]

    return TinyLM()


def default_db() -> str:
    return str(Path("runhealth-demo") / "runhealth.db")


def run_demo(config: DemoConfig, console: Console, quiet: bool = False) -> dict[str, Any]:
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("the demo trains a model: install the trainer extra (torch)") from exc
    say = (lambda *_a, **_k: None) if quiet else console.print
    db = config.db or default_db()
    service = prepare_store(ServiceConfig.from_environ(os.environ, db=db), os.environ)
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    with service.engine.begin() as connection:
        token = queries.create_run(connection, run)
    trainer = Trainer(config)
    incarnation = str(uuid.uuid4())
    started = time.time()
    say(
        f"[bold]runhealth demo[/bold]: training a {sum(p.numel() for p in trainer.model.parameters()):,}-parameter "
        f"character LM for {config.steps} steps on the CPU; step {config.corrupt_step}'s batch is corrupted."
    )
    with (
        BackgroundServer(service) as server,
        httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {token}"}, timeout=30) as client,
    ):
        pending: list[dict[str, Any]] = [
            {
                "kind": "run_start",
                "incarnation": incarnation,
                "time": time.time(),
                "world_size": 1,
                "config": {"model": "tiny-char-lm", "steps": config.steps},
            }
        ]
        for step in range(1, config.steps + 1):
            values = trainer.step(step)
            pending.append(
                {
                    "kind": "step",
                    "incarnation": incarnation,
                    "rank": 0,
                    "attempt": step,
                    "step": step,
                    "consumed": step * config.batch_size,
                    "time": time.time(),
                    "node": "localhost",
                    **values,
                }
            )
            if step % 50 == 0:
                say(f"  step {step:4d}  loss {values['reported_loss']:.3f}")
            if step % config.send_every == 0:
                _send(client, run, pending)
        pending.append({"kind": "run_finish", "incarnation": incarnation, "time": time.time()})
        _send(client, run, pending)
        incidents = client.get(f"/v1/runs/{run}/incidents").raise_for_status().json()["incidents"]
    elapsed = time.time() - started
    caught = [i for i in incidents if i["first_step"] == config.corrupt_step]
    say(_incident_table(run, incidents))
    verdict = (
        f"[green]caught[/green]: the corrupted batch at step {config.corrupt_step} opened incident "
        f"{caught[0]['id']}"
        if caught
        else f"[red]missed[/red]: no incident starts at step {config.corrupt_step}"
    )
    say(
        f"{verdict} ({elapsed:.1f} s). Explore: runhealth incidents --db {db}; "
        f"runhealth incident {caught[0]['id'] if caught else 'ID'} --db {db}"
    )
    return {
        "run": run,
        "db": db,
        "steps": config.steps,
        "corrupt_step": config.corrupt_step,
        "caught": bool(caught),
        "seconds": elapsed,
        "incidents": incidents,
    }


def _send(client: httpx.Client, run: str, pending: list[dict[str, Any]]) -> None:
    if pending:
        client.post(f"/v1/runs/{run}/records", json={"records": pending}).raise_for_status()
        pending.clear()


def _incident_table(run: str, incidents: list[dict[str, Any]]) -> Table:
    view = Table(title=f"Incidents of run {run}", title_justify="left")
    for column in ("id", "kind", "severity", "first step", "last step", "summary"):
        view.add_column(column)
    for i in incidents:
        view.add_row(
            str(i["id"]),
            i["kind"],
            i["severity"],
            str(i["first_step"]),
            str(i["last_step"]),
            i["summary"],
        )
    return view
