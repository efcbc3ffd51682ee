"""The hook's configuration: one frozen dataclass per component, composed here.

The environment is read once, at the edge (``RunHealthConfig.from_environ``), from a mapping
the caller passes in; no component reads ``os.environ`` itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from collectors.directives import DirectiveConfig
from collectors.embedded import EmbeddedConfig
from collectors.ring import RingConfig
from collectors.sender import SenderConfig
from collectors.spool import SpoolConfig
from collectors.tokens import IGNORE_INDEX
from collectors.transport import TransportConfig
from policies.protocol import SAMPLE_ID_LIMIT  # the service's bound on a step's sample ids


class ConfigError(ValueError):
    """A setting (from the environment or the caller) that cannot be used; says which."""


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
    16-byte gloo all-reduce per four windows; a directive acts at most 8 windows after its
    step, well inside the margin the service gives it).
    ``canary_on_checkpoint``: run the canary suite when a checkpoint is saved (every rank
    saves at the same step, so the canary is aligned without a directive).
    """

    shift_labels: bool = True
    ignore_index: int = IGNORE_INDEX
    max_sample_ids: int = 4096
    max_phase_marks: int = 128
    nccl_trace: bool = False
    agree_every: int = 4
    canary_on_checkpoint: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.max_sample_ids <= SAMPLE_ID_LIMIT:
            raise ConfigError(
                f"HookConfig.max_sample_ids must be in [0, {SAMPLE_ID_LIMIT}], "
                f"got {self.max_sample_ids}"
            )
        if self.max_phase_marks < 2:
            raise ConfigError("HookConfig.max_phase_marks must be >= 2")
        if self.agree_every < 1:
            raise ConfigError("HookConfig.agree_every must be >= 1")


@dataclass(frozen=True)
class RunHealthConfig:
    transport: TransportConfig = field(default_factory=TransportConfig)
    hook: HookConfig = field(default_factory=HookConfig)
    ring: RingConfig = field(default_factory=RingConfig)
    sender: SenderConfig = field(default_factory=SenderConfig)
    spool: SpoolConfig = field(default_factory=SpoolConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    directives: DirectiveConfig = field(default_factory=DirectiveConfig)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RunHealthConfig:
        """Defaults, overridden by ``RUNHEALTH_*`` (and the flight recorder's own switch)."""
        try:
            return cls._from_environ(environ)
        except ValueError as exc:
            raise ConfigError(f"runhealth configuration: {exc}") from exc

    @classmethod
    def _from_environ(cls, environ: Mapping[str, str]) -> RunHealthConfig:
        defaults = cls()
        transport = TransportConfig(
            url=_text(environ, "RUNHEALTH_URL"),
            token=_text(environ, "RUNHEALTH_TOKEN"),
            run=_text(environ, "RUNHEALTH_RUN"),
        )
        sender = dataclasses.replace(
            defaults.sender,
            heartbeat_interval_s=_float(
                environ, "RUNHEALTH_HEARTBEAT_S", defaults.sender.heartbeat_interval_s
            ),
        )
        spool = dataclasses.replace(
            defaults.spool,
            directory=_text(environ, "RUNHEALTH_SPOOL_DIR") or defaults.spool.directory,
        )
        embedded = dataclasses.replace(
            defaults.embedded, db=_text(environ, "RUNHEALTH_DB") or defaults.embedded.db
        )
        hook = dataclasses.replace(defaults.hook, nccl_trace=_flight_recorder_on(environ))
        return cls(transport=transport, hook=hook, sender=sender, spool=spool, embedded=embedded)


def default_run_name(environ: Mapping[str, str], now: float) -> str:
    """A name every start of the same job agrees on when the launcher names the job
    (torchrun's ``TORCHELASTIC_RUN_ID``, Slurm's ``SLURM_JOB_ID``); else one made from the
    start time. Only rank 0's proposal is used (it is broadcast)."""
    elastic = environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":
        return f"run-{elastic}"
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}"
    return "run-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))


def _text(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name, "").strip()
    return value or None


def _float(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = _text(environ, name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from exc


def _flight_recorder_on(environ: Mapping[str, str]) -> bool:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        raw = _text(environ, name)
        if raw is not None:
            return raw.isdigit() and int(raw) > 0
    return False
