"""The device and link readers the hook starts at attach: NVML for the rank's own device, the
InfiniBand/RoCE ports once per node, each off with one setting.

- NVML (``nvml.py``): a rank training on a CUDA device samples that device, found by the UUID
  torch reports (else its CUDA index), and its samples carry the rank. A rank training on the
  CPU has no device of its own: the node's local rank 0 samples the GPUs NVML sees there,
  without a rank. Without pynvml, libnvidia-ml or a GPU the reader says so once and starts no
  thread.
- Links (``links.py``): the ports belong to the node, not to a rank, so only its local rank 0
  reads them (global rank 0 when the launcher sets no local rank). Without ports it says so
  once and starts no thread.

Both sample on their own threads and hand records to the hook's ``submit``; the hook stops
them before its last flush. ``Readers.state`` says in one line each what they do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from collectors.layout import Identity
from collectors.links import DEFAULT_ROOT, LinkReader
from collectors.nvml import NvmlReader
from collectors.samplers import RecordSink, Sampler
from policies.setting_error import ConfigError


@dataclass(frozen=True)
class ReadersConfig:
    """Which readers the hook starts, and how often they sample.

    ``nvml``: True: on by default, as the README's detection table promises its ``device`` row
    (``RUNHEALTH_READERS__NVML=0`` turns it off, e.g. where a DCGM exporter already samples).
    ``links``: True, likewise for the ``link`` row (``RUNHEALTH_READERS__LINKS=0``).
    ``nvml_interval_s``, ``links_interval_s``: 10 s, the readers' own defaults (their counters
    are cumulative, so the interval sets time resolution, not accuracy; see
    ``NvmlReader.Config`` and ``LinkReader.Config``).
    ``links_root``: ``/sys/class/infiniband``, where the kernel lists RDMA devices; a container
    that mounts the host's sysfs elsewhere names that place here.
    """

    nvml: bool = True
    links: bool = True
    nvml_interval_s: float = NvmlReader.Config.interval_s
    links_interval_s: float = LinkReader.Config.interval_s
    links_root: str = str(DEFAULT_ROOT)

    def __post_init__(self) -> None:
        if not self.nvml_interval_s > 0 or not self.links_interval_s > 0:
            raise ConfigError("ReadersConfig: nvml_interval_s and links_interval_s must be > 0")


@dataclass
class Readers:
    """The readers this rank runs, and one line each on what they do (``describe``)."""

    nvml: NvmlReader | None
    links: LinkReader | None
    plan: dict[str, str]

    @property
    def samplers(self) -> list[Sampler]:
        return [reader for reader in (self.nvml, self.links) if reader is not None]

    def describe(self) -> dict[str, str]:
        """What each reader does once started: what it samples, or why it does nothing. Ask
        once, after start and before stop (asking a stopped NVML reader would open NVML)."""
        state = dict(self.plan)
        if self.nvml is not None:
            reason = self.nvml.unavailable_reason
            devices = ", ".join(device.uuid for device in self.nvml.devices) if reason is None else ""
            state["nvml"] = f"idle: {reason}" if reason else f"sampling {devices} {state['nvml']}"
        if self.links is not None:
            reason = self.links.unavailable_reason
            state["links"] = f"idle: {reason}" if reason else f"sampling {state['links']}"
        return state


def build_readers(
    config: ReadersConfig,
    identity: Identity,
    sink: RecordSink,
    environ: Mapping[str, str],
    clock: Callable[[], float] = time.time,
) -> Readers:
    """The readers this rank should run, not yet started (the hook starts them)."""
    nvml, nvml_plan = _nvml_reader(config, identity, sink, environ, clock)
    links, links_plan = _link_reader(config, identity, sink, clock)
    return Readers(nvml, links, {"nvml": nvml_plan, "links": links_plan})


def _node_reader(identity: Identity) -> bool:
    """This rank reads for its node: its local rank 0, or global rank 0 without local ranks."""
    if identity.local_rank is None:
        return identity.rank == 0
    return identity.local_rank == 0


def _nvml_reader(
    config: ReadersConfig,
    identity: Identity,
    sink: RecordSink,
    environ: Mapping[str, str],
    clock: Callable[[], float],
) -> tuple[NvmlReader | None, str]:
    """The reader, and what it will sample (the rank's own device, or the node's GPUs)."""
    if not config.nvml:
        return None, "off (RUNHEALTH_READERS__NVML=0)"
    interval = f"every {config.nvml_interval_s:g} s"
    own: dict[str, Any] = {}
    if identity.device.startswith("cuda"):
        index = identity.device.partition(":")[2]
        if identity.device_uuid is not None:  # the UUID is sure; a CUDA index may not be NVML's
            own = {"rank": identity.rank, "device_uuid": identity.device_uuid}
        elif index.isdecimal():
            own = {"rank": identity.rank, "cuda_device": int(index)}
        plan = f"({interval}, this rank's device)"
    elif _node_reader(identity):
        plan = f"({interval}, the node's GPUs: this rank trains on the CPU)"
    else:
        return None, "not on this rank (a CPU rank: the node's first rank reads the node's GPUs)"
    reader = NvmlReader(
        sink,
        NvmlReader.Config(interval_s=config.nvml_interval_s),
        environ=environ,
        node=identity.node,
        clock=clock,
        **own,
    )
    return reader, plan


def _link_reader(
    config: ReadersConfig, identity: Identity, sink: RecordSink, clock: Callable[[], float]
) -> tuple[LinkReader | None, str]:
    if not config.links:
        return None, "off (RUNHEALTH_READERS__LINKS=0)"
    if not _node_reader(identity):
        return None, "not on this rank (the node's first rank reads its ports)"
    reader = LinkReader(
        sink,
        LinkReader.Config(interval_s=config.links_interval_s),
        root=config.links_root,
        node=identity.node,
        clock=clock,
    )
    return reader, f"ports under {config.links_root} every {config.links_interval_s:g} s"
