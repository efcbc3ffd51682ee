"""The error of a setting that cannot be used: one class for both sides.

The trainer's reader (``collectors.variables``), the service's settings (``monitor.settings``)
and every config's ``__post_init__`` that checks a setting raise it, so a caller catches one
``ConfigError`` whichever side read the value; its message names the variable, key or field.
"""


class ConfigError(ValueError):
    """A setting (from the environment, a file or the caller) that cannot be used; says which."""
