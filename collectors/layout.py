"""Who this rank is: rank, node, device, and its place in the parallel layout.

Everything here is read once, at attach, from ``torch.distributed``, a device mesh or process
groups the trainer hands over, and the injected environment mapping. Nothing here is a
collective: a rank's coordinate in a mesh or group is local knowledge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collectors import variables

if TYPE_CHECKING:
    import torch

# Mesh dimension names as torchtitan, FSDP2 and Megatron-style trainers spell them. Several
# data-parallel dimensions (HSDP's replicate x shard) combine into one data-parallel coordinate.
DATA_PARALLEL_DIMS = frozenset({"dp", "ddp", "dp_replicate", "dp_shard", "fsdp", "hsdp"})
OTHER_DIMS = {"tp": "tp", "pp": "pp", "cp": "cp"}


@dataclass(frozen=True)
class Coordinate:
    rank: int = 0
    size: int = 1


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's coordinates. Loss weighting and peer comparison happen within a
    data-parallel group; under tensor or sharded parallelism a rank's grad norm is partial."""

    dp: Coordinate = field(default_factory=Coordinate)
    tp: Coordinate = field(default_factory=Coordinate)
    pp: Coordinate = field(default_factory=Coordinate)
    cp: Coordinate = field(default_factory=Coordinate)

    def sizes(self) -> dict[str, int]:
        return {"dp": self.dp.size, "tp": self.tp.size, "pp": self.pp.size, "cp": self.cp.size}

    def ranks(self) -> dict[str, int]:
        return {
            "dp_rank": self.dp.rank,
            "tp_rank": self.tp.rank,
            "pp_rank": self.pp.rank,
            "cp_rank": self.cp.rank,
        }


def data_parallel(rank: int, world_size: int) -> ParallelLayout:
    """The default: every rank a data-parallel replica."""
    return ParallelLayout(dp=Coordinate(rank, world_size))


def layout_from_mesh(mesh: Any) -> ParallelLayout:
    """Coordinates from a ``DeviceMesh`` with named dimensions (``get_coordinate`` is local)."""
    names = mesh.mesh_dim_names or ()
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the device mesh it was given")
    sizes = [int(mesh.size(dim)) for dim in range(len(names))]
    dp = Coordinate(0, 1)
    found: dict[str, Coordinate] = {}
    for name, index, size in zip(names, coordinate, sizes, strict=True):
        if name in DATA_PARALLEL_DIMS:
            # Mixed radix in mesh order: replicate-major, shard-minor, as HSDP lays them out.
            dp = Coordinate(dp.rank * size + int(index), dp.size * size)
        elif name in OTHER_DIMS:
            found[OTHER_DIMS[name]] = Coordinate(int(index), size)
    return ParallelLayout(dp=dp, **found)


def layout_from_groups(groups: Mapping[str, Any], dist: Any) -> ParallelLayout:
    """Coordinates from process groups named ``dp``, ``tp``, ``pp``, ``cp``."""
    unknown = set(groups) - {"dp", "tp", "pp", "cp"}
    if unknown:
        raise ValueError(f"process groups must be named dp, tp, pp or cp, not {sorted(unknown)}")
    found = {
        name: Coordinate(dist.get_rank(group=group), dist.get_world_size(group=group))
        for name, group in groups.items()
    }
    return ParallelLayout(**found)


@dataclass(frozen=True)
class Identity:
    """This rank, as every record names it."""

    rank: int
    world_size: int
    local_rank: int | None
    node: str
    device: str
    device_uuid: str | None
    layout: ParallelLayout

    def record_fields(self, incarnation: str) -> dict[str, Any]:
        """The identity fields every step record of this rank carries."""
        fields: dict[str, Any] = {
            "incarnation": incarnation,
            "rank": self.rank,
            "node": self.node,
            **self.layout.ranks(),
        }
        if self.device_uuid is not None:
            fields["device_uuid"] = self.device_uuid
        return fields


def local_rank_from(environ: Mapping[str, str], world_size: int) -> int | None:
    """torchrun's ``LOCAL_RANK``, else Slurm's ``SLURM_LOCALID``; unknown in a bare launch."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        raw = environ.get(name, "")
        if raw.isdigit():
            return int(raw)
    return 0 if world_size == 1 else None


def resolve_device(requested: Any, model: Any) -> torch.device:
    """The device given, else the model's, else the current CUDA device, else the CPU."""
    import torch

    chosen: torch.device = torch.device("cpu")
    if requested is not None:
        chosen = torch.device(requested)
    elif model is not None:
        chosen = next((parameter.device for parameter in model.parameters()), chosen)
    elif torch.cuda.is_available():
        chosen = torch.device("cuda")
    if chosen.type == "cuda" and chosen.index is None:
        # An explicit index: tensors on this device compare equal to it.
        chosen = torch.device("cuda", torch.cuda.current_device())
    return chosen


def device_uuid(torch: Any, device: torch.device) -> str | None:
    """The CUDA device's UUID as NVML spells it (``GPU-...``), so samples and steps join."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        text = str(torch.cuda.get_device_properties(index).uuid)
    except (AttributeError, RuntimeError):  # an old or unusual build: the record goes without
        return None
    return text if text.startswith("GPU-") else f"GPU-{text}"


def discover_identity(
    torch: Any,
    environ: Mapping[str, str],
    *,
    device: torch.device,
    mesh: Any = None,
    groups: Mapping[str, Any] | None = None,
    hostname: Callable[[], str],
) -> Identity:
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    if mesh is not None:
        layout = layout_from_mesh(mesh)
    elif groups:
        layout = layout_from_groups(groups, dist)
    else:
        layout = data_parallel(rank, world_size)
    return Identity(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank_from(environ, world_size),
        node=variables.text(environ, variables.NODE) or hostname(),
        device=str(device),
        device_uuid=device_uuid(torch, device),
        layout=layout,
    )
