"""One of several ``runhealth serve`` replicas over one PostgreSQL: the runs it judges.

Every replica stores whatever records reach it. This thread keeps the replica's leases
(``monitor.store.leases``): every ``lease_s`` it takes runs whose judge is gone, up to its share,
and gives back any beyond it; every ``poll_s``, or as soon as a batch arrives here, it judges
each run it holds from what any replica stored (``Service.judge_arrivals``), after
``gather_s`` so that one look takes the batches that arrive together. A run taken over is
judged from the store (``Service.take_over``); one given back is forgotten first, so no two
replicas judge a run at once while both are alive. The scheduler's passes (hangs, holds,
canaries, idle windows) cover only the runs held (``Service.judged_runs``).
"""

from __future__ import annotations

import logging
import threading
import time

from monitor.config import ReplicaConfig
from monitor.service import Service
from monitor.store import queries
from monitor.store.leases import RunLeases

log = logging.getLogger("runhealth.replicas")


class ReplicaJudge:
    def __init__(self, service: Service, leases: RunLeases, config: ReplicaConfig) -> None:
        self._service = service
        self._leases = leases
        self._config = config
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="runhealth-replica", daemon=True)
        service.replicate(leases)

    def start(self) -> ReplicaJudge:
        self.refresh()  # before the first request: /healthz says what this replica judges
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop judging and give the leases back (another replica takes the runs at once)."""
        self._stop.set()
        self._service.arrived.set()
        self._thread.join(timeout=30)
        self._leases.close()

    def refresh(self) -> None:
        """One look at the leases: forget runs lost or given back, take over runs gained."""
        with self._service.engine.connect() as connection:
            runs = queries.run_ids(connection)
        changes = self._leases.refresh(runs)
        for run_id in changes.lost:
            self._service.forget(run_id)
        for run_id in changes.gained:
            self._service.take_over(run_id)
        if changes.gained or changes.lost:
            log.info(
                "replica %s judges runs %s (took %s, gave up %s)",
                self._leases.replica,
                sorted(self._leases.held()),
                list(changes.gained),
                list(changes.lost),
            )

    def judge(self) -> None:
        """Judge what arrived for every run held."""
        for run_id in sorted(self._leases.held()):
            if self._stop.is_set():
                return
            try:
                self._service.judge_arrivals(run_id)
            except Exception:  # the rows stay stored; the next look judges them
                log.exception("judging run %s failed", run_id)

    def _loop(self) -> None:
        next_lease = time.monotonic() + self._config.lease_s
        while not self._stop.is_set():
            if self._service.arrived.wait(self._config.poll_s):
                # Woken by a batch: the next ones are taken in the same look (the hook's ranks
                # each post a few records; a look per batch is mostly the look's own cost).
                self._stop.wait(self._config.gather_s)
            self._service.arrived.clear()
            if self._stop.is_set():
                return
            try:
                if time.monotonic() >= next_lease:
                    next_lease = time.monotonic() + self._config.lease_s
                    self.refresh()
                self.judge()
            except Exception:  # the store is down: keep looking; leases lost are given up above
                log.exception("replica pass failed")
