"""Does the hook add host-device synchronizations? A check for a machine with a CUDA GPU.

Runs the same small mixed-precision training bare and hooked under
``torch.cuda.set_sync_debug_mode("warn")``, counts the synchronization warnings per step on each
side, and separately those raised inside the hook's own calls. The target is zero added. Three
hooked variants cover the hook's device paths: labels on the GPU (counted there), labels on the
CPU beside a GPU loss, and a fused AdamW (the skip verdict travels as a device flag). One window
of each run overflows on purpose, so a skipped step is in every variant. A fourth runs without a
GradScaler, a fused AdamW and ``nonfinite_response="skip_update"``, one window's loss NaN: its
update is skipped by a device flag the hook computes (``collectors/skip_update.py``), compared
with the same training bare and without a scaler, and its weights must stay finite. A fifth
hands the hook a bfloat16 loss (a model trained in bf16 without autocast): every window's token
count must arrive exact (bf16 holds integers only to 256).

    python scripts/sync_check.py [--steps 30]

Prints one JSON document. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not

from collectors import HookConfig, RunHealth, RunHealthConfig  # noqa: E402
from collectors.spool import SpoolConfig  # noqa: E402
from collectors.transport import Delivery, Outcome, TransportConfig  # noqa: E402

LOG = logging.getLogger("runhealth.sync_check")
VOCAB = 512
WINDOW_TOKENS = 8 * 128  # a window's batch: 8 rows of 129 tokens, shifted
SYNC_WORDS = ("synchroniz",)  # "called a synchronizing CUDA operation"


class CountingTransport:
    """Keeps the records in memory: the check needs no service."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def post(self, records: Sequence[dict[str, Any]]) -> Delivery:
        self.records.extend(records)
        return Delivery(Outcome.DELIVERED, 200)

    def close(self) -> None:
        return None


@dataclass
class SyncCounter:
    """Synchronization warnings, in total and inside hook calls."""

    total: int = 0
    in_hook: int = 0
    examples: list[str] = field(default_factory=list)
    _inside: bool = False

    def record(self, message: warnings.WarningMessage) -> None:
        if not any(word in str(message.message) for word in SYNC_WORDS):
            return
        self.total += 1
        if self._inside:
            self.in_hook += 1
            if len(self.examples) < 5:
                self.examples.append(f"{message.filename}:{message.lineno}: {message.message}")

    @contextmanager
    def hook_call(self) -> Iterator[None]:
        self._inside = True
        try:
            yield
        finally:
            self._inside = False


@contextmanager
def sync_warnings(counter: SyncCounter) -> Iterator[None]:
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()  # after the mode went back: not counted
    for message in caught:
        counter.record(message)


@dataclass(frozen=True)
class Variant:
    name: str
    labels_on_gpu: bool = True
    fused: bool = False
    scaler: bool = True
    """False: no GradScaler, and the hook skips the nonfinite window (``skip_update``)."""
    half_loss: bool = False
    """The loss handed to the hook in bfloat16, as a model trained in bf16 without autocast
    gives it: summed in fp32 and packed unrounded (each window's token count exact)."""


def build(fused: bool, scaler: bool = True) -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 256),
        torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        torch.nn.Linear(256, VOCAB),
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    return model, optimizer, torch.amp.GradScaler("cuda") if scaler else None


def batches(steps: int) -> list[dict[str, Any]]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return [
        {"tokens": torch.randint(0, VOCAB, (8, 129), generator=generator).pin_memory(),
         "ids": list(range(8 * index, 8 * index + 8))}
        for index in range(steps)
    ]  # fmt: skip


def train_step(
    model: Any, optimizer: Any, scaler: Any, batch: dict[str, Any], overflow: bool, hook: Callable[..., None]
) -> None:
    """One window; ``hook(name, *args)`` is where the hooked side calls the hook. Without a
    scaler (``None``) it trains in bfloat16 and its faulty window's loss is NaN."""
    import torch

    tokens = batch["tokens"].cuda(non_blocking=True)
    dtype = torch.float16 if scaler is not None else torch.bfloat16
    with torch.autocast("cuda", dtype=dtype):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    if overflow:
        loss = loss * float("inf" if scaler is not None else "nan")
    hook("loss", loss, tokens, batch["tokens"])
    if scaler is None:
        loss.backward()  # type: ignore[no-untyped-call]
        hook("grad_norm", torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    hook("grad_norm", norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def run_bare(steps: int, skip_at: int, fused: bool = False, scaler_on: bool = True) -> SyncCounter:
    model, optimizer, scaler = build(fused, scaler_on)
    data = batches(steps)
    counter = SyncCounter()
    for batch in data[:3]:  # warm-up: cuBLAS, allocator, lazy inits
        train_step(model, optimizer, scaler, batch, False, lambda *_: None)
    with sync_warnings(counter):
        for index, batch in enumerate(data):
            train_step(model, optimizer, scaler, batch, index == skip_at, lambda *_: None)
    return counter


def run_hooked(variant: Variant, steps: int, skip_at: int) -> dict[str, Any]:
    model, optimizer, scaler = build(variant.fused, variant.scaler)
    data = batches(steps)
    transport = CountingTransport()
    counter = SyncCounter()
    config = RunHealthConfig(
        transport=TransportConfig(run=f"sync-check-{variant.name}"),
        spool=SpoolConfig(directory=tempfile.mkdtemp(prefix="runhealth-sync-check-")),
        hook=HookConfig(nonfinite_response="none" if variant.scaler else "skip_update"),
    )
    rh = RunHealth(
        model=model, optimizer=optimizer, scaler=scaler, transport=transport, config=config, environ={}
    ).start()

    def hook(name: str, *args: Any) -> None:
        with counter.hook_call():
            if name == "loss":
                loss, gpu_tokens, cpu_tokens = args
                loss = loss.bfloat16() if variant.half_loss else loss
                rh.loss(loss, labels=gpu_tokens if variant.labels_on_gpu else cpu_tokens)
            else:
                rh.grad_norm(args[0])

    for batch in data[:3]:
        train_step(model, optimizer, scaler, batch, False, lambda *_: None)
    with sync_warnings(counter):
        for index, batch in enumerate(data):
            with counter.hook_call():
                rh.window_start(sample_ids=batch["ids"])
            train_step(model, optimizer, scaler, batch, index == skip_at, hook)
            with counter.hook_call():
                rh.window_end()
    rh.close()
    summary = summarize_hooked(variant, counter, transport, rh, steps)
    summary["weights_finite"] = all(bool(p.isfinite().all()) for p in model.parameters())
    return summary


def summarize_hooked(
    variant: Variant, counter: SyncCounter, transport: CountingTransport, rh: RunHealth, steps: int
) -> dict[str, Any]:
    step_records = [record for record in transport.records if record["kind"] == "step"]
    return {
        "variant": variant.name,
        "syncs_per_step": counter.total / steps,
        "syncs_inside_hook_calls": counter.in_hook,
        "examples": counter.examples,
        "step_records": len(step_records),
        "skipped_attempts": [record["attempt"] for record in step_records if record.get("skipped")],
        "tokens_per_window": sorted({record.get("tokens") for record in step_records}, key=str),
        "last_record": step_records[-1] if step_records else None,
        "counters": rh.counters,
        "device_uuid": rh.identity.device_uuid,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:
        import torch
    except ImportError:
        return report({"cuda": False, "message": "torch is not installed; nothing to check"})
    if not torch.cuda.is_available():
        return report(
            {"cuda": False, "message": "no CUDA device here: the sync check needs a GPU; nothing run"}
        )
    return report(run_check(args.steps))


def run_check(steps: int) -> dict[str, Any]:
    """The whole check on this machine's CUDA device, as one JSON-able document (also called
    by scripts/device_check.py)."""
    import torch

    started = time.time()
    skip_at = steps // 2
    bare = run_bare(steps, skip_at)
    # The skip_update variant's own baseline: the same training without a scaler (a GradScaler
    # reads its found-inf flag on the host for an unfused optimizer; this one has none).
    bare_unscaled = run_bare(steps, skip_at, fused=True, scaler_on=False)
    variants = [
        Variant("labels_on_gpu"),
        Variant("labels_on_cpu", labels_on_gpu=False),
        Variant("fused_adamw", fused=True),
        Variant("fused_adamw_skip_update", fused=True, scaler=False),
        Variant("bf16_loss", half_loss=True),
    ]
    hooked = [run_hooked(variant, steps, skip_at) for variant in variants]
    bare_per_step = bare.total / steps
    for result, variant in zip(hooked, variants, strict=True):
        baseline = bare_per_step if variant.scaler else bare_unscaled.total / steps
        result["added_syncs_per_step"] = result["syncs_per_step"] - baseline
    return {
        "cuda": True,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "steps": steps,
        "skip_at_attempt": skip_at + 1,
        "bare_syncs_per_step": bare_per_step,
        "hooked": hooked,
        "target_added_syncs": 0,
        "ok": all(r["syncs_inside_hook_calls"] == 0 and r["step_records"] == steps for r in hooked)
        and all(
            r["added_syncs_per_step"] <= 0 and r["weights_finite"] and r["skipped_attempts"] == [skip_at + 1]
            for r in hooked[3:4]
        )
        and hooked[4]["tokens_per_window"] == [WINDOW_TOKENS],
        "seconds": time.time() - started,
    }


def report(document: dict[str, Any]) -> int:
    if not document.get("cuda"):
        LOG.warning("%s", document["message"])
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
