"""The transformers ``Trainer`` adapter in real short runs (a two-layer GPT-2 on the CPU) against a
real ``runhealth serve``: one step record per optimizer-step attempt, each checked against values
the test computes itself; checkpoints with manifests; a resume; skipped fp16 updates. And a
rollback directive stopping the Trainer, with an in-process transport that hands it over."""

from __future__ import annotations

import math
import subprocess
import sys
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
    run_rows,
    stored,
    stored_steps,
    wait_until_armed,
)
from tests.collectors_support import ServeProcess, child_environ, serving, step_rows
from tests.support import require_module

require_module("torch")
require_module("transformers")  # before the imports: skipped without it, failed in CI

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from collectors import RunHealth  # noqa: E402
from collectors import checkpoints as checkpoints_module  # noqa: E402
from collectors.hf import PROGRESS_FILE, RunHealthCallback  # noqa: E402

VOCAB = 128
LENGTH = 16
ROWS = 4  # per microbatch
MICROBATCHES = 2  # gradient_accumulation_steps
MAX_GRAD_NORM = 0.5  # below every norm of this model: every step clips


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory.mktemp("serve")) as process:
        yield process


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a model from a config: nothing to download


def dataset(count: int = 32) -> list[dict[str, torch.Tensor]]:
    """Causal-LM examples whose prompts (a varying prefix) are masked with -100."""
    generator = torch.Generator().manual_seed(0)
    examples = []
    for index in range(count):
        input_ids = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
        labels = input_ids.clone()
        labels[: 1 + index % 5] = -100
        examples.append({"input_ids": input_ids, "labels": labels})
    return examples


class ObservedTrainer(Trainer):
    """A Trainer that notes, by its own computation, what each window should record: each
    microbatch's summed loss and supervised tokens (after the shift and the mask), and each
    step's gradient norm before clipping and learning rate. ``poison``: the microbatch after
    whose backward a gradient is set to inf (1-based)."""

    def __init__(self, *args: Any, poison: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.poison = poison
        self.microbatches: list[tuple[float, int]] = []
        self.norms: list[float] = []
        self.lrs: list[float] = []

    def compute_loss(  # type: ignore[override]
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        loss, outputs = super().compute_loss(
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        targets = inputs["labels"][:, 1:]
        logits = outputs.logits[:, :-1].detach().float()
        total = F.cross_entropy(
            logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        self.microbatches.append((float(total), int((targets != -100).sum())))
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if len(self.microbatches) == self.poison:
            model.lm_head.weight.grad.fill_(math.inf)
        return loss

    def _clip_grad_norm(self, model: Any) -> Any:
        # Where the Trainer clips, every step: the norm the test computes here is before clipping.
        grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        self.lrs.append(self.optimizer.param_groups[0]["lr"])
        return super()._clip_grad_norm(model)


def trainer_for(output: Path, *, poison: int | None = None, **arguments: Any) -> ObservedTrainer:
    """Four windows of two microbatches of four rows, a checkpoint every two."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0
    )
    settings: dict[str, Any] = {
        "output_dir": str(output),
        "per_device_train_batch_size": ROWS,
        "gradient_accumulation_steps": MICROBATCHES,
        "max_steps": 4,
        "learning_rate": 1e-3,
        "max_grad_norm": MAX_GRAD_NORM,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_steps": 1000,
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    args = TrainingArguments(**{**settings, **arguments})
    return ObservedTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=dataset(), poison=poison)


def windows(values: list[Any]) -> list[Any]:
    """Per-microbatch values grouped by window."""
    return [values[index : index + MICROBATCHES] for index in range(0, len(values), MICROBATCHES)]


@pytest.mark.slow
@pytest.mark.parametrize("loss_kwargs", [True, False], ids=["num_items", "mean"])
def test_each_window_lands_with_its_own_values_and_each_save_with_a_manifest(
    serve: ServeProcess, tmp_path: Path, loss_kwargs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``num_items``: the Trainer passes the window's token count into the model, whose loss is
    then a share of the window's; ``mean``: a model that takes no loss arguments returns each
    microbatch's mean. The manifests are hashed off the training thread."""
    hashed_on: set[str] = set()
    real_sha256 = checkpoints_module.sha256_of

    def sha256_of(path: Path) -> str:
        hashed_on.add(threading.current_thread().name)
        return real_sha256(path)

    monkeypatch.setattr(checkpoints_module, "sha256_of", sha256_of)
    run = f"hf-run-{loss_kwargs}"
    rh = hook_for(serve, run, tmp_path)
    trainer = trainer_for(tmp_path / "out")
    trainer.model_accepts_loss_kwargs = loss_kwargs
    trainer.add_callback(RunHealthCallback(trainer, rh=rh))
    with closing(rh):  # the callback starts it, once it has watched the model
        trainer.train()
    steps = stored_steps(serve, run, 4)

    assert [s["attempt"] for s in steps] == [1, 2, 3, 4]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["skipped"] for s in steps] == [False] * 4
    assert [s["consumed"] for s in steps] == [8, 16, 24, 32]  # 2 microbatches of 4 rows, 1 rank
    assert [s["microbatches"] for s in steps] == [2] * 4
    observed = windows(trainer.microbatches)
    assert [s["tokens"] for s in steps] == [sum(tokens for _, tokens in window) for window in observed]
    for record, window in zip(steps, observed, strict=True):
        assert record["loss_sum"] == pytest.approx(sum(total for total, _ in window), rel=1e-5)
        assert record["data_wait_s"] >= 0 and record["forward_s"] >= 0 and record["optimizer_s"] >= 0
    assert [s["grad_norm"] for s in steps] == pytest.approx(trainer.norms, rel=1e-5)
    assert min(trainer.norms) > MAX_GRAD_NORM  # so each recorded norm is the one before clipping
    assert [s["lr"] for s in steps] == pytest.approx(trainer.lrs)
    assert trainer.lrs[0] > trainer.lrs[-1]  # the schedule moved: the rate is read per step

    checkpoints = stored(serve, "checkpoint_events", run, 2)
    assert [(c["step"], c["consumed"]) for c in checkpoints] == [(2, 16), (4, 32)]
    for checkpoint in checkpoints:
        folder = Path(checkpoint["path"])
        assert folder == (tmp_path / "out" / f"checkpoint-{checkpoint['step']}").resolve()
        manifest = checkpoint["manifest"]
        assert manifest["step"] == checkpoint["step"] and manifest["consumed"] == checkpoint["consumed"]
        assert checkpoint["metrics"]["runhealth.save_s"] > 0  # timed from _save_checkpoint's start
        names = {entry["path"] for entry in manifest["files"]}
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json", PROGRESS_FILE} <= names
        assert_manifest_matches(folder, manifest)
    assert hashed_on == {"runhealth-manifests"}  # never the training thread


@pytest.mark.slow
def test_a_resumed_run_continues_the_counters_from_its_checkpoint(
    serve: ServeProcess, tmp_path: Path
) -> None:
    first = hook_for(serve, "hf-resume", tmp_path / "first")
    trainer = trainer_for(tmp_path / "out")
    trainer.add_callback(RunHealthCallback(trainer, rh=first))
    with closing(first):
        trainer.train()
    second = RunHealth(config=first.config, environ={}, hostname=lambda: "node-a")  # a restart
    resumed = trainer_for(tmp_path / "out")
    resumed.add_callback(RunHealthCallback(resumed, rh=second))
    with closing(second):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))

    steps = stored_steps(serve, "hf-resume", 6)
    later = [s for s in steps if s["incarnation"] == second.incarnation]
    assert [(s["attempt"], s["step"], s["consumed"]) for s in later] == [(1, 3, 24), (2, 4, 32)]
    (resume,) = stored(serve, "resume_events", "hf-resume", 1)
    assert resume["incarnation"] == second.incarnation
    assert resume["checkpoint_path"] == str((tmp_path / "out" / "checkpoint-2").resolve())
    assert resume["checkpoint_step"] == 2
    restored = resume["restored"]
    assert restored["consumed"] == 16 and restored["resumed_step"] == 2 and restored["global_step"] == 2
    assert restored["optimizer"]["optimizer_step_max"] == 2  # the optimizer's own count came back
    assert restored["scheduler"]["last_epoch"] == 2


class LabelsPoppedTrainer(ObservedTrainer):
    """The transformers docs' custom loss: ``compute_loss`` pops the labels, calls the model
    without them (its output has no loss) and computes a mean cross-entropy itself."""

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        targets = labels[:, 1:]
        logits = outputs.logits[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        total = float(loss.detach()) * int((targets != -100).sum())
        self.microbatches.append((total, int((targets != -100).sum())))
        return (loss, outputs) if return_outputs else loss


@pytest.mark.slow
def test_a_loss_computed_outside_the_model_is_recorded_with_the_labels_it_was_given(
    serve: ServeProcess, tmp_path: Path
) -> None:
    run = "hf-popped-labels"
    rh = hook_for(serve, run, tmp_path)
    base = trainer_for(tmp_path / "out", save_strategy="no")
    trainer = LabelsPoppedTrainer(model=base.model, args=base.args, train_dataset=base.train_dataset)
    callback = RunHealthCallback(trainer, rh=rh)
    trainer.add_callback(callback)
    with closing(rh):
        trainer.train()
    steps = stored_steps(serve, run, 4)

    observed = windows(trainer.microbatches)
    assert [s["tokens"] for s in steps] == [sum(tokens for _, tokens in window) for window in observed]
    for record, window in zip(steps, observed, strict=True):
        assert record["loss_sum"] == pytest.approx(sum(total for total, _ in window), rel=1e-5)
    assert "compute_loss" not in vars(trainer)  # unwrapped at the end of training


@pytest.mark.slow
def test_a_resume_that_ignores_the_data_skip_is_a_data_cursor_reset(
    serve: ServeProcess, tmp_path: Path
) -> None:
    """``ignore_data_skip``: the Trainer restores the weights, the optimizer and the schedule
    of checkpoint-2 (half way through the epoch) but restarts the epoch's loader at its first
    batch. The resume says so, and the service finds the data cursor reset."""
    first = hook_for(serve, "hf-data-skip", tmp_path / "first")
    trainer = trainer_for(tmp_path / "out")
    trainer.add_callback(RunHealthCallback(trainer, rh=first))
    with closing(first):
        trainer.train()
    second = RunHealth(config=first.config, environ={}, hostname=lambda: "node-a")
    resumed = trainer_for(tmp_path / "out", ignore_data_skip=True)
    resumed.add_callback(RunHealthCallback(resumed, rh=second))
    with closing(second):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))

    (resume,) = stored(serve, "resume_events", "hf-data-skip", 1)
    assert resume["restored"]["consumed"] == 0 and resume["restored"]["ignore_data_skip"] is True
    steps = stored_steps(serve, "hf-data-skip", 6)
    later = [s for s in steps if s["incarnation"] == second.incarnation]
    assert [(s["step"], s["consumed"]) for s in later] == [(3, 8), (4, 16)]  # the epoch again
    findings = stored(serve, "findings", "hf-data-skip", 1)
    assert "data_cursor_reset" in {f["kind"] for f in findings if f["incarnation"] == second.incarnation}


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_a_skipped_fp16_update_is_an_attempt_but_not_a_step(
    serve: ServeProcess, tmp_path: Path, optim: str
) -> None:
    """fp16 on a GPU: accelerate's GradScaler skips the update when a gradient overflowed, and
    ``global_step`` counts the attempt anyway. The CPU has no fp16 AMP, so the scaler a GPU run
    gets is given to accelerate here (scale 1: the norms stay comparable) and window 3's
    gradient is poisoned. A fused AdamW is stepped anyway and skips inside its kernel."""
    run = f"hf-skip-{optim}"
    rh = hook_for(serve, run, tmp_path)
    trainer = trainer_for(tmp_path / "out", poison=2 * MICROBATCHES + 2, optim=optim, save_strategy="no")
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    trainer.add_callback(RunHealthCallback(trainer, rh=rh))
    with closing(rh):
        trainer.train()
    steps = stored_steps(serve, run, 4)

    assert trainer.state.global_step == 4  # the Trainer counts the skipped attempt
    assert [s["attempt"] for s in steps] == [1, 2, 3, 4]
    assert [s["step"] for s in steps] == [1, 2, 2, 3]
    assert [s["skipped"] for s in steps] == [False, False, True, False]
    assert [s["consumed"] for s in steps] == [8, 16, 24, 32]  # the skipped window's data was used
    assert steps[2]["grad_norm"] == math.inf and trainer.norms[2] == math.inf
    assert [s["loss_scale"] for s in steps] == [1.0, 1.0, 1.0, 0.5]  # backed off after the skip
    if optim == "adamw_torch":
        # accelerate saw the skip (the scaler never called step), so the schedule held. A fused
        # optimizer is always stepped: accelerate reports no skip and the Trainer advances the
        # schedule, while the record above still says skipped.
        assert steps[3]["lr"] == steps[2]["lr"]
    assert rh.progress == {"attempt": 4, "step": 3, "consumed": 32}


class WaitForDirectives(TrainerCallback):
    """Added after the adapter: holds training until the hook it started has armed the rollback."""

    def __init__(self, transport: DirectingTransport) -> None:
        self.transport = transport

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wait_until_armed(self.transport)


@pytest.mark.slow
def test_a_rollback_directive_stops_the_trainer_at_its_step(tmp_path: Path) -> None:
    transport = DirectingTransport()
    rh = directed_hook(transport, tmp_path)
    trainer = trainer_for(tmp_path / "out", save_strategy="no")
    trainer.add_callback(RunHealthCallback(trainer, rh=rh))
    trainer.add_callback(WaitForDirectives(transport))
    with closing(rh):
        trainer.train()

    assert trainer.state.global_step == 2  # of 4: stopped after the window that reached step 2
    assert [s["attempt"] for s in transport.records("step")] == [1, 2]
    assert rh.directive == {"id": 7, "kind": "rollback", "step": 2, **ROLLBACK["payload"]}
    (ack,) = transport.records("directive_ack")
    assert (ack["directive_id"], ack["status"], ack["step"]) == (7, "done", 2)


def test_importing_the_adapter_without_transformers_says_what_to_install() -> None:
    message = import_message_without("transformers", "collectors.hf")
    assert "pip install 'runhealth[hf]'" in message  # and ``import collectors`` needed none


CRASHING_TRAINER = """
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from collectors.hf import RunHealthCallback

class Crash(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise RuntimeError("the training crashed")

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16, bos_token_id=0, eos_token_id=0)
data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 128, (32, 16)).unbind()]
args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, max_steps=8, save_strategy="no",
                         logging_steps=1000, report_to="none", use_cpu=True, disable_tqdm=True)
trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data)
trainer.add_callback(RunHealthCallback(trainer))  # its own hook, from the environment
trainer.add_callback(Crash())
trainer.train()
"""


@pytest.mark.slow
def test_a_trainer_that_raises_still_delivers_its_windows_and_finishes_failed(
    serve: ServeProcess, tmp_path: Path
) -> None:
    """``train()`` raising calls no callback (no ``on_train_end``): the hook is closed at the
    interpreter's exit. Before that, the windows still queued were lost with the process."""
    run = "hf-crash"
    script = tmp_path / "trainer.py"
    script.write_text(CRASHING_TRAINER)
    environ = child_environ(
        RUNHEALTH_URL=serve.url,
        RUNHEALTH_TOKEN=serve.create_run(run),
        RUNHEALTH_RUN=run,
        RUNHEALTH_SPOOL_DIR=str(tmp_path / "spool"),
        HF_HUB_OFFLINE="1",
        TMPDIR=str(tmp_path),
    )
    child = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 1 and "the training crashed" in child.stderr, child.stderr[-3000:]
    assert [row["attempt"] for row in step_rows(serve.db, run)] == [1, 2, 3]
    assert [row["finish_status"] for row in run_rows(serve.db, "incarnations", run)] == ["failed"]
