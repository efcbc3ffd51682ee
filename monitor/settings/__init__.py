"""The service's settings: every config dataclass field, set by default, a TOML file or the
environment (``RUNHEALTH_POLICIES__SPIKE__Z=10``), read in one place."""

from monitor.settings.reader import Effective, Setting, read_settings, service_config

__all__ = ["Effective", "Setting", "read_settings", "service_config"]
