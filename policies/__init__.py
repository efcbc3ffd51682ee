"""Pure decision logic: plain records in, findings and decisions out.

Nothing here imports a web framework, a database or torch. Every threshold lives in a typed
config dataclass whose docstring says where its default comes from.
"""

from policies.types import Finding, IncidentView, Severity, StepPoint

__all__ = ["Finding", "IncidentView", "Severity", "StepPoint"]
