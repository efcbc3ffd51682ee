"""Judging: the engine over windows, summaries, incidents, hangs, devices, canaries, resumes."""
