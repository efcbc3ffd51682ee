"""NVIDIA XID codes: what each one says about the device, as a table the config carries.

An XID is the driver's report of an event on a GPU. Many are not hardware faults at all: every
process that dies on a GPU (an illegal address, Ctrl-C, SIGKILL, an OOM-killed rank) leaves
XIDs 13, 31, 43 or 45 behind, so treating every XID as a failing GPU would blame hardware for
every crashed job. The table says, per code, what caused it and how severe it is for a run.

Source: NVIDIA, "Analyzing Xid Errors with the Xid Catalog" (Ampere and newer),
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, driver R565-R575
revision: its "Resolution Bucket (Immediate Action)" is quoted per entry as ``action``. The
application set also matches the one NVIDIA's Kubernetes device plugin skips when it judges
device health (k8s-device-plugin ``internal/rm/health.go``: 13, 31, 43, 45, 68). Codes 61 and
92 are described in the older XID listing (docs.nvidia.com/deploy/xid-errors/index.html).
A code not in the table is reported as unknown, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from policies.types import Severity

XID_CATALOG_SOURCE = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"


class XidCause(StrEnum):
    # The process faulted (or was killed); the GPU stays healthy.
    APPLICATION = "application"
    # Memory (ECC, row remapping), bus (PCIe) or link (NVLink) hardware reported a fault.
    HARDWARE = "hardware"
    # The GPU stopped working and needs a reset; firmware, driver or hardware may be the cause.
    DEVICE = "device"
    # A summary or test message about other events.
    INFORMATIONAL = "informational"


@dataclass(frozen=True)
class XidEntry:
    name: str
    cause: XidCause
    severity: Severity
    action: str  # the catalog's immediate action


_APP, _HW, _DEV, _INFO = XidCause.APPLICATION, XidCause.HARDWARE, XidCause.DEVICE, XidCause.INFORMATIONAL
_I, _W, _C = Severity.INFO, Severity.WARNING, Severity.CRITICAL

# code: (what it is, cause, severity for a run, the catalog's immediate action)
_TABLE: dict[int, tuple[str, XidCause, Severity, str]] = {
    13: ("graphics engine exception: an illegal address or instruction in a kernel", _APP, _I, "RESTART_APP"),
    31: ("GPU memory page fault (an illegal address, typically an application bug)", _APP, _I, "RESTART_APP"),
    32: ("push buffer DMA error: mostly PCIe signal quality, not the application", _HW, _W, "RESTART_APP"),
    43: ("GPU stopped a channel after a software fault; the GPU stays healthy", _APP, _I, "IGNORE"),
    45: ("preemptive cleanup of an aborted process (Ctrl-C, kill, GPU reset)", _APP, _I, "WORKFLOW_XID_45"),
    46: ("GPU stopped processing", _DEV, _C, "RESET_GPU"),
    48: ("double-bit (uncorrectable) ECC error", _HW, _C, "WORKFLOW_XID_48"),
    61: ("internal micro-controller breakpoint/warning (older GPUs)", _DEV, _W, "RESET_GPU"),
    62: ("internal micro-controller halt", _DEV, _C, "RESET_GPU"),
    63: ("row remapping event: a row was remapped after an ECC error (on at next reset)", _HW, _W, "IGNORE"),
    64: ("row remapping failure: the faulty memory row could not be remapped", _HW, _C, "RESET_GPU"),
    68: ("video decoder (NVDEC0) exception", _APP, _I, "RESTART_APP"),
    74: ("NVLink error (the fault may be at the remote end of the link)", _HW, _C, "WORKFLOW_NVLINK_ERR"),
    79: ("GPU has fallen off the bus (PCIe)", _HW, _C, "RESTART_BM"),
    92: ("high single-bit (corrected) ECC error rate", _HW, _W, "IGNORE"),
    94: ("contained uncorrectable memory error: the process that hit it must end", _HW, _C, "RESTART_APP"),
    95: ("uncontained uncorrectable memory error: every process on the GPU is hit", _HW, _C, "RESET_GPU"),
    106: ("SMBPBI test message", _INFO, _I, "IGNORE"),
    107: ("SMBPBI test message (silent)", _INFO, _I, "IGNORE"),
    109: ("context switch timeout", _DEV, _C, "RESET_GPU"),
    119: ("GSP RPC timeout: the GPU System Processor firmware did not answer", _DEV, _C, "RESET_GPU"),
    120: ("GSP error (GPU System Processor firmware)", _DEV, _C, "RESET_GPU"),
    136: ("NVLink training failed", _HW, _C, "RESET_GPU"),
    137: ("NVLink privilege error: an illegal peer access, typically an application bug", _APP, _I, "IGNORE"),
    140: ("uncorrectable ECC error escaped containment", _HW, _C, "RESET_GPU"),
    143: ("GPU initialization error", _DEV, _C, "RESET_GPU"),
    144: ("NVLink SAW error", _HW, _C, "WORKFLOW_NVLINK5_ERR"),
    145: ("NVLink RLW error", _HW, _C, "WORKFLOW_NVLINK5_ERR"),
    146: ("NVLink TLW error", _HW, _C, "WORKFLOW_NVLINK5_ERR"),
    147: ("NVLink TREX error", _HW, _C, "WORKFLOW_NVLINK5_ERR"),
    148: ("NVLink NVLPW_CTRL error", _HW, _C, "WORKFLOW_NVLINK5_ERR"),
    149: ("NVLink NETIR error", _HW, _C, "WORKFLOW_NVLINK5_ERR"),
    150: ("NVLink MSE error", _HW, _C, "WORKFLOW_NVLINK5_ERR"),
    154: ("GPU recovery action changed: read it with the XID it accompanies", _INFO, _I, "XID_154"),
    156: ("resource retirement event", _HW, _W, "RESET_GPU"),
    157: ("resource retirement failure: no spare resources left for repairs", _HW, _W, "IGNORE"),
    158: ("GPU fatal timeout", _DEV, _C, "RESET_GPU"),
}
XID_CATALOG: Mapping[int, XidEntry] = MappingProxyType({code: XidEntry(*row) for code, row in _TABLE.items()})


def application_codes(catalog: Mapping[int, XidEntry] = XID_CATALOG) -> frozenset[int]:
    return frozenset(code for code, entry in catalog.items() if entry.cause is XidCause.APPLICATION)
