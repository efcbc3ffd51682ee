"""``runhealth drill``: the reference text's four restart drills, run against the user's own
trainer (``convention.py`` says what the trainer is asked to do)."""
