"""The run's own tail: the largest one-step excursions it has had without an incident.

Some runs are heavy-tailed by nature. The training loss of a small-batch, high-learning-rate
run (modded-nanogpt's ScaleUp1B, logged per step) jumps +20% above its trailing median for one
step about once in 60 steps and +75% about once in 3,000, recovering at the next step every
time: its robust spread (a MAD) is fitted to the body of the distribution and says nothing
about that tail. Judged by the spread alone, such a run raises a "spike" every few thousand
steps. A single-step excursion no larger than the ones the run has already had, and recovered
from, is the run's normal, however large; one clearly beyond them is not. The memory holds the
largest excursions over a horizon of steps, so a run whose tail is thin (Pythia, Megatron: no
excursion past +11% in 153,000 steps) keeps its full sensitivity.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TailMemory:
    """The ``keep`` largest excursions (excess over the trailing median), newest horizon only.

    Entries are (excess, step), largest first. An entry that ages out of the horizon is dropped;
    a smaller one that was crowded out before is not recalled, so after an expiry the tail is
    underestimated (the rule is then more sensitive, never less).
    """

    entries: tuple[tuple[float, int], ...] = ()

    def add(self, excess: float, step: int, keep: int, oldest: int) -> TailMemory:
        """With ``excess`` at ``step`` remembered, entries before step ``oldest`` forgotten."""
        kept = [e for e in self.entries if e[1] >= oldest]
        if len(kept) >= keep and excess <= kept[-1][0]:
            return TailMemory(tuple(kept)) if len(kept) != len(self.entries) else self
        kept.append((excess, step))
        kept.sort(key=lambda e: -e[0])
        return TailMemory(tuple(kept[:keep]))

    def level(self, rank: int, oldest: int) -> float | None:
        """The ``rank``-th largest excursion from step ``oldest`` on; ``None`` when fewer."""
        if rank < 1:
            return None
        recent = [excess for excess, step in self.entries if step >= oldest]
        return recent[rank - 1] if len(recent) >= rank else None

    def before(self, step: int) -> TailMemory:
        """Only the excursions before ``step``: those of an abandoned timeline are gone."""
        kept = tuple(e for e in self.entries if e[1] < step)
        return self if len(kept) == len(self.entries) else TailMemory(kept)
