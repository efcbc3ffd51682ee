"""The error of a setting that cannot be used, raised by whichever stage reads the setting.

Its own module, at the bottom of the service's layers: the configuration that composes every
stage's settings and the stages that read their own (tracing's ``OTEL_*``) raise the same error,
which the CLI prints as one line."""

from policies.setting_error import ConfigError as ConfigError  # one class on both sides
