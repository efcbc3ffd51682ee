"""Memory plans checked before a launch: does what must be resident fit the device budget?

The reference text's rule ("Reject impossible memory plans before launching"): base weights
take parameters x bits / 8 bytes; at an ideal 4 bits a 70B model is 35e9 bytes, 32.6 GiB,
which exceeds a 24 GiB usable budget by 8.6 GiB before anything else is counted. Passing the
base-only check does not establish training fit: whatever the plan leaves unstated
(quantization metadata, adapters, activations, gradients, optimizer moments, buffers) must fit
in the headroom that remains, and the verdict says how much that is.

Every term is in bytes per device: a sharded plan divides its terms by the shard count
before it gets here (``MemoryPlan.shards``).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryPlan:
    """What a launch intends to keep on one device.

    ``parameters`` and ``bits`` give the base weights. The optional terms are the plan's own
    figures: trainable parameters with their gradient bits and optimizer bytes (mixed-precision
    Adam keeps two fp32 moments and an fp32 master copy: 12 bytes a parameter), activations
    and any other resident memory, in GiB. ``shards`` divides parameters, gradients and
    optimizer state (ZeRO-3/FSDP full sharding); activations are per device already."""

    parameters: float
    bits: float
    budget_gib: float
    trainable_parameters: float = 0.0
    gradient_bits: float = 0.0
    optimizer_bytes_per_parameter: float = 0.0
    activations_gib: float = 0.0
    other_gib: float = 0.0
    shards: int = 1

    def __post_init__(self) -> None:
        positive = {"parameters": self.parameters, "bits": self.bits, "budget_gib": self.budget_gib}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"MemoryPlan.{name} must be > 0, got {value}")
        optional = {
            "trainable_parameters": self.trainable_parameters,
            "gradient_bits": self.gradient_bits,
            "optimizer_bytes_per_parameter": self.optimizer_bytes_per_parameter,
            "activations_gib": self.activations_gib,
            "other_gib": self.other_gib,
        }
        for name, value in optional.items():
            if value < 0:
                raise ValueError(f"MemoryPlan.{name} must be >= 0, got {value}")
        if self.shards < 1:
            raise ValueError(f"MemoryPlan.shards must be >= 1, got {self.shards}")
        if self.trainable_parameters > self.parameters:
            raise ValueError(
                f"MemoryPlan.trainable_parameters ({fmt_count(self.trainable_parameters)}) exceeds "
                f"parameters ({fmt_count(self.parameters)})"
            )


@dataclass(frozen=True)
class MemoryTerm:
    name: str
    bytes: float
    arithmetic: str


@dataclass(frozen=True)
class MemoryVerdict:
    fits: bool
    terms: tuple[MemoryTerm, ...]
    total_bytes: float
    budget_bytes: float
    base_only: bool
    """No term beyond the base weights was given: a fit says only that they fit."""

    @property
    def headroom_bytes(self) -> float:
        return self.budget_bytes - self.total_bytes

    def message(self) -> str:
        terms = "; ".join(f"{t.name} {t.arithmetic}" for t in self.terms)
        total, budget = self.total_bytes / GIB, self.budget_bytes / GIB
        if not self.fits:
            return (
                f"memory plan does not fit: {terms}; total {total:.1f} GiB exceeds the "
                f"{budget:g} GiB usable budget by {-self.headroom_bytes / GIB:.1f} GiB "
                "(use a smaller model, fewer bits, sharding or offloading)"
            )
        tail = (
            "; the base weights alone were checked: the remaining "
            f"{self.headroom_bytes / GIB:.1f} GiB must hold everything else (quantization metadata, "
            "adapters, activations, gradients, optimizer moments, buffers)"
            if self.base_only
            else f"; {self.headroom_bytes / GIB:.1f} GiB headroom"
        )
        return f"memory plan fits: {terms}; total {total:.1f} GiB of {budget:g} GiB{tail}"


def fmt_count(n: float) -> str:
    """70e9 as ``70B``, 1.25e8 as ``125M``: parameter counts as people write them."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:g}"


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.4g}e9 bytes = {n_bytes / GIB:.1f} GiB"


def check_memory_plan(plan: MemoryPlan) -> MemoryVerdict:
    """The plan's terms with their arithmetic, and whether their sum fits the budget."""
    per = f" / {plan.shards} shards" if plan.shards > 1 else ""
    base = plan.parameters * plan.bits / 8 / plan.shards
    terms = [
        MemoryTerm(
            "base weights", base, f"{fmt_count(plan.parameters)} x {plan.bits:g} bits / 8{per} = {_gib(base)}"
        )
    ]
    if plan.trainable_parameters and plan.gradient_bits:
        grads = plan.trainable_parameters * plan.gradient_bits / 8 / plan.shards
        terms.append(
            MemoryTerm(
                "gradients",
                grads,
                f"{fmt_count(plan.trainable_parameters)} x {plan.gradient_bits:g} bits / 8{per} = {_gib(grads)}",
            )
        )
    if plan.trainable_parameters and plan.optimizer_bytes_per_parameter:
        moments = plan.trainable_parameters * plan.optimizer_bytes_per_parameter / plan.shards
        terms.append(
            MemoryTerm(
                "optimizer state",
                moments,
                f"{fmt_count(plan.trainable_parameters)} x {plan.optimizer_bytes_per_parameter:g} bytes{per} = {_gib(moments)}",
            )
        )
    for name, gib in (("activations", plan.activations_gib), ("other", plan.other_gib)):
        if gib:
            terms.append(MemoryTerm(name, gib * GIB, f"{gib:g} GiB"))
    total = sum(term.bytes for term in terms)
    budget = plan.budget_gib * GIB
    return MemoryVerdict(total <= budget, tuple(terms), total, budget, base_only=len(terms) == 1)
