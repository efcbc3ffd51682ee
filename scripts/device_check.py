"""One prepared check for a machine with a CUDA GPU: the sync check, every NVML field, and the
canary suite's repeatability and time on the device. Run from the repository root:

    PYTHONPATH=. python scripts/device_check.py

Options: ``--runs 30`` (warm suite runs), ``--sync-steps 30``, ``--sensitivity-trials 10``
(input bit flips per kernel and bit class; 0 skips), ``--out PATH``. The JSON document goes to
``$OUT/device_check.json`` (else ``.tmp/device_check.json``) and is rewritten after every
section, so a run cut short still leaves what it finished; a summary is printed at the end.
About a minute on an H200; the optional sensitivity section is skipped past ``--deadline-s``.

Sections: ``environment``; ``nvml`` (``collectors.nvml.describe()``: every field the reader
knows, and which were not read and why); ``canary`` (CUBLAS_WORKSPACE_CONFIG=:4096:8 set
before CUDA starts; context start, the cold first run, ``--runs`` warm runs: wall time,
per-kernel device time from CUDA events recorded by the suite's own fault hooks, the host's
fingerprinting cost, distinct fingerprints per kernel (must be 1), the same fingerprints
from a fresh process, golden comparison, an injected output flip caught, the trainer's
numerics restored, the stack before and after the first GEMM); ``sync_check``
(scripts/sync_check.py); ``sensitivity`` (benchmarks/canary_sensitivity.py on the GPU).

It imports torch, pynvml (through collectors.nvml), the trainer-side ``collectors`` package,
``policies`` and the two files above, nothing of the service: ``monitor``, SQLAlchemy, FastAPI,
polars, pydantic and the like are blocked at import, as the GPU machine has none of them, so
a run on a CPU machine proves the same. Without CUDA it says so and exits 0 (``--device cpu``
runs the canary sections on the CPU, to test this script without a GPU).
Exit status: 0 when every check passed (or no CUDA); 1 when one failed.
"""

from __future__ import annotations

import os

# Before torch and CUDA start: cuBLAS promises deterministic results only with a fixed
# workspace configuration, and reads it once, when its handle is created.
PREVIOUS_CUBLAS_WORKSPACE_CONFIG = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"

import argparse  # noqa: E402
import importlib.abc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVICE_MODULES = (
    "monitor",
    "sqlalchemy",
    "fastapi",
    "starlette",
    "uvicorn",
    "polars",
    "pydantic",
    "apscheduler",
    "alembic",
    "psycopg2",
)


class _BlockService(importlib.abc.MetaPathFinder):
    """Makes the service's packages unimportable, as they are on the GPU machine."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.split(".")[0] in SERVICE_MODULES:
            raise ModuleNotFoundError(f"{fullname} is blocked: the device check runs without the service")
        return None


sys.meta_path.insert(0, _BlockService())
sys.path.insert(0, str(REPO))  # from a checkout, with or without PYTHONPATH=.

import torch  # noqa: E402

from collectors.canary import (  # noqa: E402
    KERNELS,
    CanaryConfig,
    CanaryFaults,
    SuiteRun,
    _fingerprint,  # what run_suite calls on each output: timed apart
    describe_stack,
    run_canary,
    run_suite,
    stack_key,
)


def load(relative: str, name: str) -> ModuleType:
    """A repository file as a module, by path: a top-level ``scripts`` or ``benchmarks`` package
    installed on the machine must not stand in for ours."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {relative}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


# --- sections ----------------------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": str(device),
        "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "cublas_workspace_config_before": PREVIOUS_CUBLAS_WORKSPACE_CONFIG,
        "nvidia_ml_py": _version("nvidia-ml-py"),
        "service_modules_blocked": list(SERVICE_MODULES),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        facts.update(
            device_name=props.name,
            device_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_bytes=props.total_memory,
        )
    return facts


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def nvml() -> dict[str, Any]:
    from collectors.nvml import describe

    described = describe(environ=dict(os.environ))
    devices = described.get("devices") or []
    return {
        **described,
        "not_read_total": sum(len(d.get("not_read") or {}) for d in devices),
    }


@dataclass
class DeviceClock:
    """Fault hooks that only mark time: a CUDA event (or, on the CPU, the clock) when a kernel's
    inputs and its output reach the hook; compute = last input to output. Events are read after
    the suite synchronized, so the hooks add no synchronization of their own."""

    cuda: bool
    marks: dict[str, list[Any]] = field(default_factory=dict)

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def inputs(self, kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        self.marks[kernel] = [self._mark()]
        return tensor

    def output(self, kernel: str, tensor: torch.Tensor) -> torch.Tensor:
        self.marks[kernel].append(self._mark())
        return tensor

    def faults(self) -> CanaryFaults:
        return CanaryFaults(inputs=self.inputs, output=self.output)

    def compute_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {k: float(start.elapsed_time(end)) for k, (start, end) in self.marks.items()}
        return {k: 1000 * (end - start) for k, (start, end) in self.marks.items()}


def _stats(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": round(statistics.median(ordered), 6),
        "min": round(ordered[0], 6),
        "max": round(ordered[-1], 6),
    }


def _start_device(device: torch.device) -> float:
    """Seconds to start the CUDA context (apart from the suite's cold run)."""
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _loaded_libraries(word: str) -> list[str]:
    """Shared libraries of this process whose path holds ``word`` (the stack's cuBLAS version is
    read through ctypes by soname, which could reach a toolkit's copy rather than torch's)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return sorted({line.split()[-1] for line in maps if word in line and "/" in line})
    except OSError:
        return []


def _fingerprints(run: SuiteRun) -> dict[str, str]:
    return {k: v.fingerprint for k, v in run.kernels.items()}


def _distinct(runs: Sequence[SuiteRun]) -> dict[str, int]:
    return {k: len({r.kernels[k].fingerprint for r in runs}) for k in KERNELS}


def _device_time(device: torch.device, config: CanaryConfig, runs: int) -> dict[str, float]:
    clocks = [DeviceClock(device.type == "cuda") for _ in range(runs)]
    for clock in clocks:
        run_suite(device, config, clock.faults())
    measured = [clock.compute_ms() for clock in clocks]
    return {k: round(statistics.median(m[k] for m in measured), 4) for k in KERNELS}


def _fingerprint_cost(device: torch.device, config: CanaryConfig) -> dict[str, float]:
    """Copy to host, SHA-256 and float64 summaries of outputs of the suite's sizes, in ms."""
    gpu = device.type == "cuda"
    n = config.gpu_gemm if gpu else config.cpu_gemm
    rows, cols = config.gpu_softmax if gpu else config.cpu_softmax
    elementwise = config.gpu_elementwise if gpu else config.cpu_elementwise
    outputs = {
        "gemm_fp32": torch.randn(n, n, device=device),
        "gemm_bf16": torch.randn(n, n, device=device).to(torch.bfloat16),
        "softmax_fp32": torch.randn(rows, cols, device=device),
        "elementwise_fp32": torch.randn(elementwise, device=device),
    }
    costs = {}
    for kernel, tensor in outputs.items():
        seconds = []
        for _ in range(3):
            if gpu:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            _fingerprint(tensor)
            seconds.append(time.perf_counter() - started)
        costs[kernel] = round(1000 * statistics.median(seconds), 3)
    return costs


def _numerics_restored(device: torch.device, config: CanaryConfig) -> dict[str, Any]:
    """A trainer that allows TF32 keeps it after the suite (the suite runs in IEEE fp32)."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        return {"checked": False, "reason": "torch without the fp32_precision API"}
    saved = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        run_suite(device, config)
        after = matmul.fp32_precision
    finally:
        matmul.fp32_precision = saved
    return {"checked": True, "set_before": "tf32", "after_suite": after, "ok": after == "tf32"}


def _fresh_process(device: torch.device, timeout_s: float) -> dict[str, Any]:
    """One suite run in a new process (a new CUDA context, new cuBLAS handles)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--fingerprints-only", "--device", str(device)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"ok": False, "returncode": done.returncode, "stderr_tail": done.stderr[-2000:]}
    return {"fingerprints": json.loads(lines[-1]), "seconds": round(time.perf_counter() - started, 2)}


def _flip_caught(
    device: torch.device, config: CanaryConfig, golden: dict[str, str], sensitivity: Any
) -> dict[str, Any]:
    """One output bit flipped in the bf16 GEMM: it must miss its golden and be re-run at once."""
    import random

    flip = sensitivity.OutputFlip("gemm_bf16", random.Random(5))
    outcome = run_canary(device, config, golden=golden, faults=CanaryFaults(output=flip))
    return {
        "missed": list(outcome.missed),
        "rerun": outcome.rerun is not None,
        "ok": outcome.missed == ("gemm_bf16",),
    }


def _guarded(run: Callable[[], Any]) -> Any:
    """A secondary measurement: its failure is recorded beside the others, not instead of them."""
    try:
        return run()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "ok": False}


def canary(device: torch.device, runs: int, fresh_timeout_s: float, sensitivity: Any) -> dict[str, Any]:
    config = CanaryConfig()
    context_s = _start_device(device)
    stack_before = describe_stack(device)  # cuBLAS may not be loaded yet: see stack_after
    cold = run_suite(device, config)
    stack_after = describe_stack(device)
    warm = [run_suite(device, config) for _ in range(runs)]
    distinct = _distinct([cold, *warm])
    golden = _fingerprints(warm[0])
    matched = run_canary(device, config, golden=golden, stack=stack_after)
    fresh = _guarded(lambda: _fresh_process(device, fresh_timeout_s))
    result: dict[str, Any] = {
        "config": {"gemm": config.gpu_gemm, "reduction": config.gpu_reduction, "softmax": list(config.gpu_softmax),
                   "elementwise": config.gpu_elementwise, "time_budget_s": config.time_budget_s},
        "stack": stack_after,
        "stack_key": stack_key(stack_after),
        "stack_before_first_gemm_differs": stack_key(stack_before) != stack_key(stack_after),
        "stack_before_first_gemm": stack_before,
        "loaded_cublas": _loaded_libraries("libcublas"),
        "context_start_s": round(context_s, 4),
        "cold_run_s": round(cold.seconds, 5),
        "warm_runs": runs,
        "warm_s": _stats([r.seconds for r in warm]),
        "over_budget_runs": sum(r.over_budget for r in warm),
        "device_compute_ms_median": _guarded(lambda: _device_time(device, config, 5)),
        "host_fingerprint_ms": _guarded(lambda: _fingerprint_cost(device, config)),
        "distinct_fingerprints": distinct,
        "repeatable": all(v == 1 for v in distinct.values()),
        "cold_matches_warm": _fingerprints(cold) == golden,
        "fingerprints": golden,
        "summaries": {k: list(v.summary) for k, v in warm[0].kernels.items()},
        "golden_compare": {"missed": list(matched.missed), "ok": matched.missed == () and matched.rerun is None},
        "fresh_process": {**fresh, "matches": fresh.get("fingerprints") == golden},
        "flip_caught": _guarded(lambda: _flip_caught(device, config, golden, sensitivity)),
        "numerics_restored": _guarded(lambda: _numerics_restored(device, config)),
    }  # fmt: skip
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    result["ok"] = bool(
        result["repeatable"]
        and result["cold_matches_warm"]
        and result["golden_compare"]["ok"]
        and result["fresh_process"]["matches"]
        and result["flip_caught"]["ok"]
        and result["numerics_restored"].get("ok", True)
    )
    return result


def sensitivity_section(device: torch.device, trials: int, module: Any) -> dict[str, Any]:
    measured: dict[str, Any] = module.measure(device, CanaryConfig(), trials, 5, 1)
    measured["markdown"] = module.markdown(measured)
    return measured


# --- driver ------------------------------------------------------------------------------------


@dataclass
class Report:
    path: Path
    document: dict[str, Any] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def section(self, name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one section; an exception is recorded, and the other sections still run."""
        started = time.perf_counter()
        try:
            result = run()
        except Exception as exc:  # one broken section must not lose the others' results
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["section_seconds"] = round(time.perf_counter() - started, 2)
        if "error" in result or result.get("ok") is False:
            self.failed.append(name)
        self.document[name] = result
        self.write()
        return result

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.document, indent=2, default=str))


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "device_check.json" if out else REPO / ".tmp" / "device_check.json"


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="warm suite runs")
    parser.add_argument("--sync-steps", type=int, default=30)
    parser.add_argument(
        "--sensitivity-trials", type=int, default=10, help="per kernel and bit class; 0 skips"
    )
    parser.add_argument(
        "--deadline-s", type=float, default=150.0, help="skip the optional section after this"
    )
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to test this script without a GPU")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--fingerprints-only", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def summary(report: Report) -> str:
    doc = report.document
    verdict = "FAILED: " + ", ".join(report.failed) if report.failed else "all passed"
    lines = [f"device check: {doc.get('message') or verdict}"]
    env = doc.get("environment", {})
    lines.append(
        f"  {env.get('device_name', env.get('device'))}, torch {env.get('torch')}, CUDA {env.get('torch_cuda')}"
    )
    nv = doc.get("nvml", {})
    lines.append(
        f"  nvml: available={nv.get('available')} driver={nv.get('driver_version')} "
        f"devices={len(nv.get('devices') or [])} not_read={nv.get('not_read_total')}"
    )
    can = doc.get("canary", {})
    if "warm_s" in can:
        lines.append(
            f"  canary: stack {can['stack_key']}, cold {can['cold_run_s']} s, warm median "
            f"{can['warm_s']['median']} s over {can['warm_runs']} runs, distinct {can['distinct_fingerprints']}, "
            f"fresh process matches={can['fresh_process']['matches']}"
        )
        lines.append(
            f"  canary device compute ms {can['device_compute_ms_median']}; host fingerprint ms "
            f"{can['host_fingerprint_ms']}"
        )
    sync = doc.get("sync_check", {})
    if "hooked" in sync:
        lines.append(
            f"  sync check ok={sync['ok']} bare/step={sync['bare_syncs_per_step']} "
            + " ".join(f"{h['variant']}:+{h['added_syncs_per_step']}" for h in sync["hooked"])
        )
    if "markdown" in doc.get("sensitivity", {}):
        lines.append(doc["sensitivity"]["markdown"])
    for name, section in doc.items():
        if isinstance(section, dict) and "error" in section:
            lines.append(f"  {name}: {section['error']}")
    lines.append(f"  written to {report.path}")
    return "\n".join(lines)  # fmt: skip


def fingerprints_only(device: torch.device) -> int:
    """The child of ``_fresh_process``: one suite run, its fingerprints as one JSON line."""
    print(json.dumps(_fingerprints(run_suite(device, CanaryConfig()))))
    return 0


def main() -> int:
    args = arguments()
    started = time.perf_counter()
    wanted = torch.device(args.device)
    if args.fingerprints_only:
        return fingerprints_only(wanted)
    report = Report(args.out or default_out())
    cuda = torch.cuda.is_available()
    report.section("environment", lambda: environment(wanted))
    report.section("nvml", nvml)
    if wanted.type == "cuda" and not cuda:
        report.document["message"] = (
            "no CUDA device here: the device check needs a GPU; only the imports and NVML ran"
        )
        report.write()
        print(summary(report))
        return 0
    sensitivity = load("benchmarks/canary_sensitivity.py", "runhealth_canary_sensitivity")
    report.section("canary", lambda: canary(wanted, args.runs, 180.0, sensitivity))
    sync_check = load("scripts/sync_check.py", "runhealth_sync_check")
    if wanted.type == "cuda":
        report.section("sync_check", lambda: sync_check.run_check(args.sync_steps))
    else:  # loaded all the same: its imports are checked without the service too
        report.section("sync_check", lambda: {"skipped": "needs CUDA", "imported": True})
    if args.sensitivity_trials > 0 and time.perf_counter() - started < args.deadline_s:
        report.section(
            "sensitivity", lambda: sensitivity_section(wanted, args.sensitivity_trials, sensitivity)
        )
    report.document["total_seconds"] = round(time.perf_counter() - started, 1)
    report.write()
    print(summary(report))
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
