"""The canary suite: small computations that exercise what training uses, from inputs
generated on the device from a fixed seed, each giving a fingerprint of its output bytes.

Kernels: a GEMM in float32 and in bfloat16, a large reduction, a softmax over long rows and
an elementwise chain. The suite sets the numerics it needs (deterministic algorithms,
``highest`` float32 matmul precision, TF32 and reduced-precision reductions off) for its own
run and restores the trainer's settings afterwards. It synchronizes with the device (it must
read its outputs), so it runs at an aligned step between windows, never inside one.

Fingerprints are only comparable on one stack: device model, SM count, MIG mode, driver,
CUDA, cuBLAS and torch versions and the numerics flags (on the CPU: CPU model, torch, BLAS
build and thread count, which changes the BLAS partitioning).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KERNELS = ("gemm_fp32", "gemm_bf16", "reduction_fp32", "softmax_fp32", "elementwise_fp32")

# A hook on the suite's tensors, for emulating faults in tests and for the sensitivity study:
# (kernel, tensor) -> tensor. ``inputs`` sees each input, ``output`` each output.
TensorHook = Callable[[str, "torch.Tensor"], "torch.Tensor"]


@dataclass(frozen=True)
class CanaryConfig:
    """Shapes and seed of the suite.

    Sizes are chosen so one run costs well under a second. Measured on a 2-core EPYC VM, the
    CPU shapes take 13 ms at 1 thread (benchmarks/canary.py). On a GPU the device work should
    be milliseconds, but fingerprinting its outputs on the host (48 MiB of SHA-256 and float64
    summaries) cost 0.11-0.19 s on that CPU, so expect ~0.1-0.2 s per run; no GPU has run it
    yet (scripts/device_check.py measures the split). ``time_budget_s`` is checked after each run: a
    suite that takes longer is reported as over budget (it still completes).
    """

    seed: int = 20_240_607
    gpu_gemm: int = 2048
    cpu_gemm: int = 256
    gpu_reduction: int = 1 << 24
    cpu_reduction: int = 1 << 20
    gpu_softmax: tuple[int, int] = (64, 32_768)
    cpu_softmax: tuple[int, int] = (16, 8_192)
    gpu_elementwise: int = 1 << 22
    cpu_elementwise: int = 1 << 18
    time_budget_s: float = 2.0

    def __post_init__(self) -> None:
        if min(self.gpu_gemm, self.cpu_gemm, self.gpu_reduction, self.cpu_reduction) < 16:
            raise ValueError("CanaryConfig: sizes must be at least 16")
        if self.time_budget_s <= 0:
            raise ValueError("CanaryConfig.time_budget_s must be positive")


@dataclass(frozen=True)
class KernelOutput:
    fingerprint: str
    summary: tuple[float, ...]
    deterministic: bool = True

    def as_wire(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "summary": list(self.summary),
            "deterministic": self.deterministic,
        }


@dataclass(frozen=True)
class SuiteRun:
    kernels: dict[str, KernelOutput]
    seconds: float
    over_budget: bool


@dataclass(frozen=True)
class CanaryOutcome:
    """One canary on one device: the run, the immediate re-run when it missed its golden."""

    stack: dict[str, Any]
    stack_key: str
    first: SuiteRun
    rerun: SuiteRun | None = None
    missed: tuple[str, ...] = ()

    def as_wire(self) -> dict[str, Any]:
        return {
            "stack": self.stack,
            "stack_key": self.stack_key,
            "kernels": {k: v.as_wire() for k, v in self.first.kernels.items()},
            "rerun": {k: v.as_wire() for k, v in self.rerun.kernels.items()} if self.rerun else None,
            "seconds": self.first.seconds + (self.rerun.seconds if self.rerun else 0.0),
            "over_budget": self.first.over_budget,
        }


@dataclass
class CanaryFaults:
    inputs: TensorHook | None = None
    output: TensorHook | None = None


# (backend, op) switches of the fp32-precision API (torch >= 2.9); "ieee" is full float32.
PRECISION_SWITCHES = (
    ("cuda", "matmul"),
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
)


def _switch(backend: str, op: str) -> Any:
    import torch

    return getattr(getattr(torch.backends, backend), op)


@contextlib.contextmanager
def canary_numerics() -> Iterator[dict[str, Any]]:
    """The suite's numerics for its own run; the trainer's settings restored afterwards.

    Precision goes through the fp32-precision API where torch has it: reading or writing the
    legacy flags (``allow_tf32``, ``set_float32_matmul_precision``) after a trainer used the
    new API raises, and the new API reflects legacy settings, so saving and restoring through
    it keeps either kind of trainer as it was.
    """
    import torch

    new_api = hasattr(torch.backends, "fp32_precision")
    saved: dict[str, Any] = {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cuda_bf16_reduced": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "cuda_fp16_reduced": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    }
    if new_api:
        saved["precision"] = {key: _switch(*key).fp32_precision for key in PRECISION_SWITCHES}
    else:
        saved["matmul_precision"] = torch.get_float32_matmul_precision()
        saved["cuda_tf32"] = torch.backends.cuda.matmul.allow_tf32
        saved["cudnn_tf32"] = torch.backends.cudnn.allow_tf32
    try:
        # warn_only: cuBLAS asks for CUBLAS_WORKSPACE_CONFIG to promise determinism; without
        # it the GEMM still runs (and is recorded in the stack as such) rather than failing.
        torch.use_deterministic_algorithms(True, warn_only=True)
        if new_api:
            for key in PRECISION_SWITCHES:
                _switch(*key).fp32_precision = "ieee"
        else:
            torch.set_float32_matmul_precision("highest")
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        flags = {
            "deterministic": True,
            "fp32_precision": "ieee",
            "tf32": False,
            "reduced_precision_reduction": False,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        }
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUBLAS_WORKSPACE_CONFIG.*")
            yield flags
    finally:
        torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["warn_only"])
        if new_api:
            for key, value in saved["precision"].items():
                _switch(*key).fp32_precision = value
        else:
            torch.set_float32_matmul_precision(saved["matmul_precision"])
            torch.backends.cuda.matmul.allow_tf32 = saved["cuda_tf32"]
            torch.backends.cudnn.allow_tf32 = saved["cudnn_tf32"]
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved["cuda_bf16_reduced"]
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = saved["cuda_fp16_reduced"]
        torch.backends.cudnn.deterministic = saved["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]


def _fingerprint(tensor: torch.Tensor) -> KernelOutput:
    import torch

    host = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(host.view(torch.uint8).numpy().tobytes()).hexdigest()
    wide = host.double()
    summary = (float(wide.sum()), float(wide.abs().max()), float(wide.norm()))
    return KernelOutput(digest, summary)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def _kernels(
    device: torch.device, config: CanaryConfig
) -> dict[str, Callable[[torch.Generator, CanaryFaults], torch.Tensor]]:
    import torch

    gpu = device.type == "cuda"
    n = config.gpu_gemm if gpu else config.cpu_gemm
    reduction = config.gpu_reduction if gpu else config.cpu_reduction
    rows, cols = config.gpu_softmax if gpu else config.cpu_softmax
    elementwise = config.gpu_elementwise if gpu else config.cpu_elementwise

    def inputs(name: str, faults: CanaryFaults, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return [faults.inputs(name, t) if faults.inputs else t for t in tensors]

    def gemm(dtype: torch.dtype, name: str) -> Callable[[torch.Generator, CanaryFaults], torch.Tensor]:
        def run(g: torch.Generator, faults: CanaryFaults) -> torch.Tensor:
            a = torch.randn(n, n, generator=g, device=device).to(dtype)
            b = torch.randn(n, n, generator=g, device=device).to(dtype)
            a, b = inputs(name, faults, a, b)
            return a @ b

        return run

    def reduce(g: torch.Generator, faults: CanaryFaults) -> torch.Tensor:
        (x,) = inputs("reduction_fp32", faults, torch.randn(reduction, generator=g, device=device))
        return torch.stack([x.sum(), (x * x).sum(), x.abs().max()])

    def softmax(g: torch.Generator, faults: CanaryFaults) -> torch.Tensor:
        (x,) = inputs("softmax_fp32", faults, torch.randn(rows, cols, generator=g, device=device) * 4)
        return torch.softmax(x, dim=-1)

    def chain(g: torch.Generator, faults: CanaryFaults) -> torch.Tensor:
        x, y = inputs(
            "elementwise_fp32",
            faults,
            torch.randn(elementwise, generator=g, device=device),
            torch.rand(elementwise, generator=g, device=device),
        )
        return torch.nn.functional.gelu(x * y + torch.exp(-x.abs())) * torch.tanh(y)

    return {
        "gemm_fp32": gemm(torch.float32, "gemm_fp32"),
        "gemm_bf16": gemm(torch.bfloat16, "gemm_bf16"),
        "reduction_fp32": reduce,
        "softmax_fp32": softmax,
        "elementwise_fp32": chain,
    }


def run_suite(device: torch.device, config: CanaryConfig, faults: CanaryFaults | None = None) -> SuiteRun:
    """One run of every kernel, each from its own seeded generator on the device."""
    import torch

    faults = faults or CanaryFaults()
    outputs: dict[str, KernelOutput] = {}
    started = time.perf_counter()
    with canary_numerics():
        for index, (name, kernel) in enumerate(_kernels(device, config).items()):
            out = kernel(_generator(device, config.seed + index), faults)
            if faults.output is not None:
                out = faults.output(name, out)
            outputs[name] = _fingerprint(out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    return SuiteRun(outputs, seconds, seconds > config.time_budget_s)


def run_canary(
    device: torch.device,
    config: CanaryConfig,
    golden: Mapping[str, str] | None = None,
    faults: CanaryFaults | None = None,
    stack: dict[str, Any] | None = None,
) -> CanaryOutcome:
    """Run the suite; when a kernel misses its golden fingerprint, re-run at once on the same
    device, so the service can tell a persistent fault from a transient one."""
    described = stack if stack is not None else describe_stack(device)
    first = run_suite(device, config, faults)
    missed = tuple(
        k for k, v in first.kernels.items() if golden and k in golden and golden[k] != v.fingerprint
    )
    rerun = run_suite(device, config, faults) if missed else None
    return CanaryOutcome(described, stack_key(described), first, rerun, missed)


def stack_key(stack: Mapping[str, Any]) -> str:
    canonical = json.dumps(stack, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def describe_stack(device: torch.device) -> dict[str, Any]:
    """What makes fingerprints comparable (see the module docstring)."""
    import torch

    stack: dict[str, Any] = {
        "torch": torch.__version__,
        "device_type": device.type,
        "flags": {"deterministic": True, "matmul_precision": "highest", "tf32": False},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        stack.update(
            device_name=props.name,
            sm_count=props.multi_processor_count,
            cuda=torch.version.cuda,
            capability=f"{props.major}.{props.minor}",
            cublas=_cublas_version(),
            cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            **_nvml_facts(device),
        )
    else:
        stack.update(
            cpu_model=_cpu_model(),
            blas=_blas_build(),
            threads=torch.get_num_threads(),
            machine=platform.machine(),
        )
    return stack


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _blas_build() -> str:
    import torch

    shown = torch.__config__.show()
    for part in shown.replace("\n", ",").split(","):
        if "BLAS_INFO" in part:
            blas = part.split("=", 1)[1].strip()
            break
    else:
        blas = "unknown"
    mkl = next((line.strip(" -") for line in shown.splitlines() if "Math Kernel Library" in line), "")
    return f"{blas} {mkl}".strip()


def _cublas_version() -> str | None:
    """cuBLAS's own version (cublasGetProperty) from the library torch loaded, best effort."""
    import ctypes

    for name in ("libcublas.so", "libcublas.so.13", "libcublas.so.12", "libcublas.so.11"):
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        parts = []
        for kind in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            if library.cublasGetProperty(kind, ctypes.byref(value)) != 0:
                return None
            parts.append(str(value.value))
        return ".".join(parts)
    return None


def _nvml_facts(device: torch.device) -> dict[str, Any]:
    """Driver version and MIG mode from NVML, when it is there."""
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML: the stack says so
        return {"driver": None, "mig": None}
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(
            uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        )
        try:
            mig = bool(pynvml.nvmlDeviceGetMigMode(handle)[0])
        except pynvml.NVMLError:
            mig = None
        return {"driver": pynvml.nvmlSystemGetDriverVersion(), "mig": mig}
    except Exception:  # a field this driver does not have: recorded as unknown
        return {"driver": None, "mig": None}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


@dataclass
class CanaryBudget:
    """Seconds spent in canaries against seconds of training, for the schedule's cap."""

    canary_seconds: float = 0.0
    runs: int = 0
    timings: list[float] = field(default_factory=list)

    def add(self, outcome: CanaryOutcome) -> None:
        spent = outcome.first.seconds + (outcome.rerun.seconds if outcome.rerun else 0.0)
        self.canary_seconds += spent
        self.runs += 1
        self.timings = [*self.timings[-63:], spent]
