"""Recovery: decisions, directives, checkpoints, evidence, replay jobs and quarantine."""
