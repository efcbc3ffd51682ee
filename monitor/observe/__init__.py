"""Observing the service: Prometheus metrics, Grafana dashboards, OpenTelemetry spans."""
