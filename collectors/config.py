"""The hook's configuration: one frozen dataclass per component, composed here.

The environment is read once, at the edge (``RunHealthConfig.from_environ``, through
``collectors.variables``), from a mapping the caller passes in; no component reads
``os.environ`` itself. An explicit config is merged over the environment's, field by field.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from collectors.directives import DirectiveConfig
from collectors.embedded import EmbeddedConfig
from collectors.readers import ReadersConfig
from collectors.relay import RelayConfig
from collectors.ring import RingConfig
from collectors.sender import SenderConfig
from collectors.spool import SpoolConfig
from collectors.tokens import IGNORE_INDEX
from collectors.transport import TransportConfig
from collectors.variables import read_components, text
from policies.protocol import SAMPLE_ID_LIMIT  # the service's bound on a step's sample ids
from policies.setting_error import ConfigError as ConfigError  # one class on both sides

# What the trainer itself does with a nonfinite window (the service's responses are
# ``policies.responses``): nothing, or skip its update.
NONFINITE_RESPONSES = ("none", "skip_update")


@dataclass(frozen=True)
class HookConfig:
    """What the hook records per window.

    ``shift_labels``: True, the Hugging Face causal-LM convention (labels are the inputs; the
    model shifts them), so the first label of each row is not a target (see ``tokens.py``).
    ``ignore_index``: -100, the default of ``torch.nn.functional.cross_entropy`` and of HF.
    ``max_sample_ids``: 4096 per window, enough for the batch ids of a large global batch's
    local share; a longer list keeps its first ids (logged once). The service takes 100,000.
    ``max_phase_marks``: 128 phase changes per window (about 60 microbatches) for timings.
    ``nccl_trace``: whether ``stack_dump`` asks for the NCCL flight recorder; on when the
    recorder is (``TORCH_FR_BUFFER_SIZE`` or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` above 0).
    ``agree_every``: the window boundaries at which ranks agree on directives (every 4th: one
    16-byte all-reduce on the default group per four windows; a
    directive acts at most 8 windows after its step, well inside the margin the service gives
    it).
    ``canary_on_checkpoint``: run the canary suite when a checkpoint is saved (every rank
    saves at the same step, so the canary is aligned without a directive).
    ``manifest_settle_s``: 1 s without a size or modification-time change before a saved
    checkpoint's files are hashed off the training thread (``manifests.py``). Every rank leaves
    the step's collectives together, so the other ranks' files of one save start landing within
    milliseconds of rank 0's; a second covers a loaded host, and only delays the record.
    ``nonfinite_response``: ``"none"``, or ``"skip_update"``: the optimizer step of a window
    whose gradient norm is NaN or infinite is skipped on the device, without a host sync and
    without the service (``skip_update.py``; the optimizer must be fused or stepped by a
    GradScaler). Off by default: skipping an update changes the run, the user's choice.
    ``deterministic_data``: False. Whether the same batches follow a checkpoint every time it is
    restored (a fixed order, a seeded sampler fast-forwarded to the cursor); only then are the
    sample ids after a resume compared with those the run saw after the checkpoint. A trainer
    that draws at random after a restart (nanoGPT's ``get_batch``) draws other batches however
    well it restored, so the default makes no such claim (``rh.resumed(deterministic_data=...)``
    says it per resume).
    """

    shift_labels: bool = True
    ignore_index: int = IGNORE_INDEX
    max_sample_ids: int = 4096
    max_phase_marks: int = 128
    nccl_trace: bool = False
    agree_every: int = 4
    canary_on_checkpoint: bool = False
    nonfinite_response: str = "none"
    manifest_settle_s: float = 1.0
    deterministic_data: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.max_sample_ids <= SAMPLE_ID_LIMIT:
            raise ConfigError(
                f"HookConfig.max_sample_ids must be in [0, {SAMPLE_ID_LIMIT}], got {self.max_sample_ids}"
            )
        if self.max_phase_marks < 2:
            raise ConfigError("HookConfig.max_phase_marks must be >= 2")
        if self.agree_every < 1:
            raise ConfigError("HookConfig.agree_every must be >= 1")
        if self.nonfinite_response not in NONFINITE_RESPONSES:
            raise ConfigError(
                f"HookConfig.nonfinite_response must be one of {', '.join(NONFINITE_RESPONSES)}, "
                f"got {self.nonfinite_response!r}"
            )
        if not self.manifest_settle_s >= 0:
            raise ConfigError(f"HookConfig.manifest_settle_s must be >= 0, got {self.manifest_settle_s}")


@dataclass(frozen=True)
class RunHealthConfig:
    transport: TransportConfig = field(default_factory=TransportConfig)
    hook: HookConfig = field(default_factory=HookConfig)
    ring: RingConfig = field(default_factory=RingConfig)
    sender: SenderConfig = field(default_factory=SenderConfig)
    spool: SpoolConfig = field(default_factory=SpoolConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    directives: DirectiveConfig = field(default_factory=DirectiveConfig)
    readers: ReadersConfig = field(default_factory=ReadersConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str], explicit: RunHealthConfig | None = None
    ) -> RunHealthConfig:
        """Defaults, overridden by the environment (``collectors.variables``: every component
        field as ``RUNHEALTH_<COMPONENT>__<FIELD>``, the flat names, the flight recorder's own
        switch), overridden by what ``explicit`` (the hook's ``config=``) sets.

        "Sets" is "differs from the default": ``explicit`` is merged field by field, so
        ``RunHealthConfig(hook=HookConfig(shift_labels=False))`` changes the label rule and keeps
        ``RUNHEALTH_URL``, ``RUNHEALTH_TOKEN`` and ``RUNHEALTH_RUN``. A field given its default
        value cannot be told from one left alone, so there the environment's value stands; to
        ignore a variable, hand the hook an ``environ`` without it.
        """
        try:
            found = read_components(cls._recorder_defaults(environ), environ)
            return found if explicit is None else cls._overlay(found, explicit)
        except ValueError as exc:
            raise ConfigError(f"runhealth configuration: {exc}") from exc

    @classmethod
    def _recorder_defaults(cls, environ: Mapping[str, str]) -> RunHealthConfig:
        """The defaults, with ``nccl_trace`` on when the flight recorder is."""
        defaults = cls()
        hook = dataclasses.replace(defaults.hook, nccl_trace=_flight_recorder_on(environ))
        return dataclasses.replace(defaults, hook=hook)

    @classmethod
    def _overlay(cls, found: RunHealthConfig, explicit: RunHealthConfig) -> RunHealthConfig:
        merged: RunHealthConfig = _overlay(found, explicit, cls())
        return merged


def _overlay(base: Any, explicit: Any, default: Any) -> Any:
    """``base`` with each field of ``explicit`` that differs from ``default``'s, component by
    component; each component's ``__post_init__`` judges the merge."""
    if not dataclasses.is_dataclass(explicit) or isinstance(explicit, type):
        return base if explicit == default else explicit
    changes = {
        item.name: _overlay(
            getattr(base, item.name), getattr(explicit, item.name), getattr(default, item.name)
        )
        for item in dataclasses.fields(explicit)
        if item.init
    }
    return dataclasses.replace(base, **changes)


def launcher_run_name(environ: Mapping[str, str]) -> str | None:
    """A name every start of the same job agrees on, when the launcher names the job
    (torchrun's ``TORCHELASTIC_RUN_ID``, Slurm's ``SLURM_JOB_ID``, both kept by a requeue)."""
    elastic = text(environ, "TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        return run_name_from(f"run-{elastic}")
    slurm = text(environ, "SLURM_JOB_ID")
    if slurm:
        return run_name_from(f"slurm-{slurm}")
    return None


def default_run_name(environ: Mapping[str, str], now: float) -> str:
    """The launcher's name for the job, else one made from the start time (so another start
    of the same script is another run). Only rank 0's proposal is used (it is broadcast)."""
    return launcher_run_name(environ) or "run-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))


def run_name_from(text: str) -> str:
    """``text`` as a run name the service takes (``policies.protocol.RUN_NAME``): a launcher's
    job id may hold characters a name may not (a slash, a space)."""
    return re.sub(r"[^A-Za-z0-9._:-]", "-", text)[:200]


def _flight_recorder_on(environ: Mapping[str, str]) -> bool:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        raw = text(environ, name)
        if raw is not None:
            return raw.isdigit() and int(raw) > 0
    return False
