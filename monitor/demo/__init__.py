"""``runhealth demo``: the main job, end to end on a real small training (see ``run.py``)."""

from monitor.demo.run import DemoConfig, DemoError, run_demo

__all__ = ["DemoConfig", "DemoError", "run_demo"]
