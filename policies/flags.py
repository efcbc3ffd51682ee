"""How a yes/no setting is spelled, one way on both sides.

The service's settings, the trainer's environment reader and the OpenTelemetry switch all
read a boolean through ``parse_flag``: ``1``, ``true``, ``yes``, ``on`` are true and ``0``,
``false``, ``no``, ``off`` are false, in any case and with surrounding spaces ignored. Anything
else is an error rather than a silent false: ``RUNHEALTH_QUARANTINE_LIVE=ture`` must not leave
quarantine in dry-run without a word (nor ``=enabled`` switch it on).
"""

from __future__ import annotations

from policies.setting_error import ConfigError

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class FlagError(ConfigError):
    """A yes/no setting spelled some other way; the message names the setting."""


def parse_flag(raw: str, name: str) -> bool:
    """``raw`` as a boolean; ``name`` (the variable or key) is only for the error."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise FlagError(f"{name} must be one of {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}, got {raw!r}")
