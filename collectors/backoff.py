"""How long the sender waits before asking the service again: capped exponential backoff with
full jitter, drawn from a generator seeded per rank.

Every rank of a job loses the service at the same moment (it restarted, the network dropped),
and with a plain doubling every rank would then ask again at the same moments, all 16,384 of
them at once, for as long as the outage lasts, and again at its end. Drawing each wait at random
within the doubling interval spreads them over it. Seeded from the rank's identity, the draws
differ from rank to rank (and between two jobs' rank 0s) and repeat for one rank, so a test
can replay them.
"""

from __future__ import annotations

import hashlib
import random


class Backoff:
    """The waits of one sender: the n-th consecutive failure waits a draw from
    ``[0, min(max_s, initial_s * 2**n)]`` ("full jitter"), or that bound itself without jitter.
    Used by one thread."""

    def __init__(
        self, initial_s: float, max_s: float, *, jitter: bool = True, seed: int | None = None
    ) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._jitter = jitter
        # None: seeded from the system's entropy, still different on every rank.
        self._random = random.Random(seed)
        self._failures = 0

    @property
    def failures(self) -> int:
        """Consecutive failures since the last success."""
        return self._failures

    def ceiling_s(self) -> float:
        """The most the next wait can be."""
        # The exponent stops growing once the cap is reached: 2**n would overflow a float
        # after about a thousand failures (a long outage at short delays).
        doublings = min(self._failures, 64)
        return min(self._max_s, self._initial_s * 2.0**doublings)

    def next_delay_s(self) -> float:
        """The wait after one more failure."""
        ceiling = self.ceiling_s()
        self._failures += 1
        return self._random.uniform(0.0, ceiling) if self._jitter else ceiling

    def reset(self) -> None:
        """The service answered: the next outage starts from the first interval again."""
        self._failures = 0


def rank_seed(run: str, incarnation: str, rank: int) -> int:
    """A seed for one rank of one incarnation of one run, the same in every process that asks
    (``hash`` of a string is salted per process, so it would not repeat)."""
    digest = hashlib.blake2b(f"{run}\0{incarnation}\0{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
