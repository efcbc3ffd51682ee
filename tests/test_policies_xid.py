import pytest

from policies.types import Severity
from policies.xid import XID_CATALOG, XidCause, application_codes


def test_the_codes_every_killed_process_leaves_are_application_codes() -> None:
    assert {13, 31, 43, 45} <= application_codes()
    for code in (13, 31, 43, 45):
        assert XID_CATALOG[code].cause is XidCause.APPLICATION
        assert XID_CATALOG[code].severity is Severity.INFO


@pytest.mark.parametrize("code", [48, 64, 74, 79, 94, 95, 140])
def test_uncorrectable_memory_bus_and_link_codes_are_critical_hardware(code: int) -> None:
    entry = XID_CATALOG[code]
    assert (entry.cause, entry.severity) == (XidCause.HARDWARE, Severity.CRITICAL)


@pytest.mark.parametrize("code", [63, 92])
def test_repaired_or_corrected_memory_events_are_hardware_warnings(code: int) -> None:
    entry = XID_CATALOG[code]
    assert (entry.cause, entry.severity) == (XidCause.HARDWARE, Severity.WARNING)


@pytest.mark.parametrize("code", [46, 62, 109, 119, 120])
def test_a_gpu_that_needs_a_reset_is_critical_without_blaming_silicon(code: int) -> None:
    entry = XID_CATALOG[code]
    assert (entry.cause, entry.severity, entry.action) == (XidCause.DEVICE, Severity.CRITICAL, "RESET_GPU")


def test_every_entry_is_complete_and_only_faults_are_critical() -> None:
    for code, entry in XID_CATALOG.items():
        assert code > 0 and entry.name and entry.action
        if entry.severity is Severity.CRITICAL:
            assert entry.cause in (XidCause.HARDWARE, XidCause.DEVICE), code
        if entry.cause is XidCause.APPLICATION:
            assert entry.severity is Severity.INFO, code


def test_the_catalog_is_read_only() -> None:
    with pytest.raises(TypeError):
        XID_CATALOG[13] = XID_CATALOG[48]  # type: ignore[index]
