"""``runhealth demo``: the main job, end to end on a real small training (see ``run.py``).

The package imports nothing itself: its trainers (``worker``, ``drill_trainer``) start as
``python -m monitor.demo.<name>`` in every rank, and must not pay for the demo's service side."""
