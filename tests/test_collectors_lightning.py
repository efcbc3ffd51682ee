"""The Lightning adapter in real short runs (a tiny language model on the CPU) against a real
``runhealth serve``: one step record per optimizer-step attempt, each checked against values the
test computes itself; checkpoint files with manifests; a resume; skipped fp16 updates; the grad
norm taken from Lightning's own clipping (automatic and manual optimization) and none without
clipping. And a rollback directive stopping the trainer, with an in-process transport that
hands it over."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from tests.adapters_support import (
    ROLLBACK,
    DirectingTransport,
    assert_manifest_matches,
    directed_hook,
    hook_for,
    import_message_without,
    stored,
    stored_steps,
    wait_until_armed,
)
from tests.collectors_support import ServeProcess, serving
from tests.support import require_module

require_module("torch")
require_module("lightning")  # before the imports: skipped without it, failed in CI

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from collectors import RunHealth  # noqa: E402
from collectors import checkpoints as checkpoints_module  # noqa: E402
from collectors.lightning import RunHealthCallback  # noqa: E402

VOCAB = 32
LENGTH = 9
ROWS = 4  # per batch
CLIP = 0.5  # below every norm of this model: every step clips

# lightning 2.6 builds torch's LeafSpec, which torch 2.13 deprecates (a FutureWarning, so the
# DeprecationWarning filter for lightning.* in pyproject does not cover it): theirs to fix.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory.mktemp("serve")) as process:
        yield process


def loader(count: int = 32) -> torch.utils.data.DataLoader[dict[str, Any]]:
    """Examples whose prompts (a varying prefix) are masked with -100; ``ids`` names each."""
    generator = torch.Generator().manual_seed(0)
    examples = []
    for index in range(count):
        input_ids = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
        labels = input_ids.clone()
        labels[: 1 + index % 4] = -100
        examples.append({"input_ids": input_ids, "labels": labels, "ids": index})
    return torch.utils.data.DataLoader(examples, batch_size=ROWS)  # type: ignore[arg-type]


def total_norm(module: torch.nn.Module) -> float:
    """The 2-norm of the module's gradients as they are now, computed here, apart from the hook."""
    grads = [p.grad.float() for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


class TinyLM(pl.LightningModule):
    """Notes, by its own computation, what each window should record: each batch's summed loss
    and supervised tokens, each step's norm before Lightning clips (when it clips) and rate.
    ``poison``: batch indices after whose backward a gradient is set to inf."""

    def __init__(self, *, fused: bool = False, poison: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        self.fused = fused
        self.poison = poison
        self.batches: list[tuple[float, int]] = []
        self.norms: list[float] = []
        self.lrs: list[float] = []
        self.batch_index = -1

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        self.batch_index = batch_idx
        logits = self.head(self.embed(batch["input_ids"]))[:, :-1].reshape(-1, VOCAB).float()
        targets = batch["labels"][:, 1:].reshape(-1)
        total = F.cross_entropy(logits.detach(), targets, ignore_index=-100, reduction="sum")
        self.batches.append((float(total), int((targets != -100).sum())))
        return F.cross_entropy(logits, targets, ignore_index=-100)  # a mean over supervised tokens

    def on_after_backward(self) -> None:
        if self.batch_index in self.poison:
            assert self.head.weight.grad is not None
            self.head.weight.grad.fill_(math.inf)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        if gradient_clip_val:
            self.norms.append(total_norm(self))  # before Lightning's own clipping, below
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def trainer_for(callback: RunHealthCallback, root: Path, **settings: Any) -> pl.Trainer:
    arguments: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "accumulate_grad_batches": 2,
        "gradient_clip_val": CLIP,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(root),
        "callbacks": [callback],
    }
    return pl.Trainer(**{**arguments, **settings})


def labels_of(batch: dict[str, Any]) -> Any:
    return batch["labels"]


def saving(root: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=-1)


@pytest.mark.slow
def test_each_window_lands_with_its_own_values_and_each_save_with_a_manifest(
    serve: ServeProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed_on: set[str] = set()  # the manifests are hashed off the training thread
    real_sha256 = checkpoints_module.sha256_of

    def sha256_of(path: Path) -> str:
        hashed_on.add(threading.current_thread().name)
        return real_sha256(path)

    monkeypatch.setattr(checkpoints_module, "sha256_of", sha256_of)
    rh = hook_for(serve, "pl-run", tmp_path)
    module = TinyLM()
    callback = RunHealthCallback(rh, labels_from=labels_of)
    trainer = trainer_for(callback, tmp_path, callbacks=[callback, saving(tmp_path)])
    with closing(rh):  # the callback starts it, once it has watched the model
        trainer.fit(module, loader())
    steps = stored_steps(serve, "pl-run", 4)

    assert trainer.global_step == 4
    assert [s["attempt"] for s in steps] == [1, 2, 3, 4]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["skipped"] for s in steps] == [False] * 4
    assert [s["consumed"] for s in steps] == [8, 16, 24, 32]  # 2 batches of 4 rows, 1 rank
    assert [s["microbatches"] for s in steps] == [2] * 4
    windows = [module.batches[index : index + 2] for index in range(0, 8, 2)]
    assert [s["tokens"] for s in steps] == [sum(tokens for _, tokens in window) for window in windows]
    for record, window in zip(steps, windows, strict=True):
        assert record["loss_sum"] == pytest.approx(sum(total for total, _ in window), rel=1e-5)
        # the loss training_step returned, undivided by the accumulation: the mean of the two
        means = [total / tokens for total, tokens in window]
        assert record["reported_loss"] == pytest.approx(sum(means) / 2, rel=1e-5)
    assert [s["grad_norm"] for s in steps] == pytest.approx(module.norms, rel=1e-5)
    assert min(module.norms) > CLIP  # so each recorded norm is the one before clipping
    assert [s["lr"] for s in steps] == pytest.approx(module.lrs)
    assert module.lrs == pytest.approx([1e-2, 5e-3, 1e-2 / 3, 2.5e-3])

    checkpoints = stored(serve, "checkpoint_events", "pl-run", 2)
    assert [(c["step"], c["consumed"]) for c in checkpoints] == [(2, 16), (4, 32)]
    for checkpoint in checkpoints:
        path = Path(checkpoint["path"])
        assert path.parent == (tmp_path / "checkpoints").resolve() and path.suffix == ".ckpt"
        manifest = checkpoint["manifest"]
        assert manifest["step"] == checkpoint["step"] and manifest["consumed"] == checkpoint["consumed"]
        assert checkpoint["metrics"]["runhealth.save_s"] > 0  # timed from the wrapped save's start
        assert_manifest_matches(path, manifest)  # the single file is the entry "."
        saved = torch.load(path, weights_only=False)["callbacks"]["RunHealthCallback"]
        assert (saved["step"], saved["consumed"]) == (checkpoint["step"], checkpoint["consumed"])
    assert hashed_on == {"runhealth-manifests"}


@pytest.mark.slow
# The resumed run saves nothing, so it has no ModelCheckpoint to restore, and Lightning says so.
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create")
def test_a_resumed_run_continues_the_counters_from_its_checkpoint(
    serve: ServeProcess, tmp_path: Path
) -> None:
    """Epochs of two windows, so the step-2 checkpoint ends an epoch: Lightning restarts a plain
    DataLoader at its first batch, so only such a checkpoint continues the data where it was."""
    first = hook_for(serve, "pl-resume", tmp_path / "first")
    callback = RunHealthCallback(first, labels_from=labels_of)
    with closing(first):
        trainer_for(callback, tmp_path, callbacks=[callback, saving(tmp_path)]).fit(TinyLM(), loader(16))
    (checkpoint,) = (tmp_path / "checkpoints").glob("*step=2.ckpt")

    second = RunHealth(config=first.config, environ={}, hostname=lambda: "node-a")  # a restart
    callback = RunHealthCallback(second, labels_from=labels_of)
    with closing(second):
        trainer = trainer_for(callback, tmp_path / "again", enable_checkpointing=False)
        trainer.fit(TinyLM(), loader(16), ckpt_path=str(checkpoint))

    steps = stored_steps(serve, "pl-resume", 6)
    later = [s for s in steps if s["incarnation"] == second.incarnation]
    assert [(s["attempt"], s["step"], s["consumed"]) for s in later] == [(1, 3, 24), (2, 4, 32)]
    (resume,) = stored(serve, "resume_events", "pl-resume", 1)
    assert resume["incarnation"] == second.incarnation
    assert resume["checkpoint_path"] == str(checkpoint.resolve()) and resume["checkpoint_step"] == 2
    restored = resume["restored"]
    assert restored["consumed"] == 16 and restored["resumed_step"] == 2 and restored["global_step"] == 2
    assert restored["optimizer"]["optimizer_step_max"] == 2  # the optimizer's own count came back
    assert restored["scheduler"]["last_epoch"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_skipped_fp16_update_is_an_attempt_but_not_a_step(
    serve: ServeProcess, tmp_path: Path, fused: bool
) -> None:
    """16-mixed with a GradScaler (given explicitly: Lightning turns 16-mixed into bf16-mixed on
    the CPU). Batch 2's gradient overflows: the scaler skips ``optimizer.step`` (a fused AdamW is
    stepped anyway and skips inside its kernel), and ``global_step`` counts the attempt anyway.
    No accumulation here, so each batch is a window and its sample ids are recorded."""
    run = "pl-skip-fused" if fused else "pl-skip"
    rh = hook_for(serve, run, tmp_path)
    module = TinyLM(fused=fused, poison=(2,))
    callback = RunHealthCallback(rh, labels_from=labels_of, sample_ids=lambda batch: batch["ids"])
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    trainer = trainer_for(
        callback,
        tmp_path,
        accumulate_grad_batches=1,
        gradient_clip_val=None if fused else CLIP,  # Lightning refuses to clip for a fused optimizer
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    with closing(rh):
        trainer.fit(module, loader())
    steps = stored_steps(serve, run, 4)

    assert trainer.global_step == 4  # Lightning counts the skipped attempt
    assert [s["attempt"] for s in steps] == [1, 2, 3, 4]
    assert [s["step"] for s in steps] == [1, 2, 2, 3]
    assert [s["skipped"] for s in steps] == [False, False, True, False]
    assert [s["consumed"] for s in steps] == [4, 8, 12, 16]
    assert [s["sample_ids"] for s in steps] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [s["loss_scale"] for s in steps] == [1024.0, 1024.0, 1024.0, 512.0]
    if fused:  # not clipped, so no norm is computed: none is recorded
        assert [s["grad_norm"] for s in steps] == [None] * 4 and module.norms == []
    else:  # clipped after the plugin unscaled the gradients: the true norm, inf at the overflow
        assert steps[2]["grad_norm"] == math.inf
        finite = [0, 1, 3]
        assert [steps[i]["grad_norm"] for i in finite] == pytest.approx(
            [module.norms[i] for i in finite], rel=1e-4
        )
    # Lightning steps a step-interval scheduler on a skipped update as on any other.
    assert [s["lr"] for s in steps] == pytest.approx([1e-2, 5e-3, 1e-2 / 3, 2.5e-3])


@pytest.mark.slow
def test_without_clipping_no_grad_norm_is_computed(serve: ServeProcess, tmp_path: Path) -> None:
    rh = hook_for(serve, "pl-noclip", tmp_path)
    module = TinyLM()
    callback = RunHealthCallback(rh, labels_from=labels_of)
    trainer = trainer_for(callback, tmp_path, gradient_clip_val=None)
    with closing(rh):
        trainer.fit(module, loader())
    steps = stored_steps(serve, "pl-noclip", 4)
    assert [s["grad_norm"] for s in steps] == [None] * 4
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and module.norms == []
    assert "clip_grad_by_norm" not in vars(trainer.precision_plugin)  # the plugin's own again


class ManualLM(TinyLM):
    """Manual optimization as such modules are written: ``self.manual_backward``, then
    ``self.clip_gradients`` when ``clip`` is set, then ``opt.step()``."""

    def __init__(self, clip: float | None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.clip = clip

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        if self.clip is not None:
            self.norms.append(total_norm(self))
            self.clip_gradients(optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")  # type: ignore[arg-type]
        optimizer.step()  # type: ignore[union-attr]
        return loss


@pytest.mark.slow
@pytest.mark.parametrize("clip", [CLIP, None], ids=["clipped", "unclipped"])
def test_manual_optimization_takes_the_norm_from_clip_gradients(
    serve: ServeProcess, tmp_path: Path, clip: float | None
) -> None:
    run = f"pl-manual-{'clip' if clip else 'noclip'}"
    rh = hook_for(serve, run, tmp_path)
    module = ManualLM(clip)
    callback = RunHealthCallback(rh, labels_from=labels_of)
    # Lightning refuses gradient_clip_val and accumulation under manual optimization.
    trainer = trainer_for(callback, tmp_path, gradient_clip_val=None, accumulate_grad_batches=1)
    with closing(rh):
        trainer.fit(module, loader())
    steps = stored_steps(serve, run, 4)

    assert [s["attempt"] for s in steps] == [1, 2, 3, 4] and [s["step"] for s in steps] == [1, 2, 3, 4]
    for record, (total, tokens) in zip(steps, module.batches, strict=True):
        assert record["tokens"] == tokens and record["loss_sum"] == pytest.approx(total, rel=1e-5)
    if clip is None:
        assert [s["grad_norm"] for s in steps] == [None] * 4
    else:
        assert [s["grad_norm"] for s in steps] == pytest.approx(module.norms, rel=1e-5)
        assert min(module.norms) > CLIP  # so each recorded norm is the one before clipping


class WaitForDirectives(pl.Callback):
    """Runs after the adapter: holds training until the hook it started has armed the rollback."""

    def __init__(self, transport: DirectingTransport) -> None:
        self.transport = transport

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wait_until_armed(self.transport)


@pytest.mark.slow
def test_a_rollback_directive_stops_the_trainer_at_its_step(tmp_path: Path) -> None:
    transport = DirectingTransport()
    rh = directed_hook(transport, tmp_path)
    callback = RunHealthCallback(rh, labels_from=labels_of)
    trainer = trainer_for(callback, tmp_path, callbacks=[callback, WaitForDirectives(transport)])
    with closing(rh):
        trainer.fit(TinyLM(), loader())

    assert trainer.global_step == 2  # of 4: stopped after the window that reached step 2
    assert [s["attempt"] for s in transport.records("step")] == [1, 2]
    assert rh.directive == {"id": 7, "kind": "rollback", "step": 2, **ROLLBACK["payload"]}
    (ack,) = transport.records("directive_ack")
    assert (ack["directive_id"], ack["status"], ack["step"]) == (7, "done", 2)


def test_importing_the_adapter_without_lightning_says_what_to_install() -> None:
    message = import_message_without("lightning", "collectors.lightning")
    assert "pip install 'runhealth[lightning]'" in message  # and ``import collectors`` needed none
