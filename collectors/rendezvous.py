"""The job's own rendezvous store, for what the embedded service's ranks must share.

``torch.distributed`` jobs already have a c10d key-value store (torchrun's, or the one
``init_process_group`` made). Rank 0 writes the service's URL and run token there once, at
attach; each rank reads them once, and at close adds one to a counter so that rank 0 stops the
service only after every rank finished sending. None of it touches the step path or the
job's process groups. Keys carry the attach's incarnation id, so a restarted job never reads
the previous start's service.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any

from collectors.embedded import Endpoint

log = logging.getLogger("runhealth.collectors")


class Rendezvous:
    def __init__(self, store: Any, incarnation: str) -> None:
        self._store = store
        self._prefix = f"runhealth/{incarnation}/"

    @classmethod
    def of_job(cls, torch: Any, incarnation: str) -> Rendezvous | None:
        """The default process group's store; None without one (a single process)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        store = getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()
        return None if store is None else cls(store, incarnation)

    def publish(self, endpoint: Endpoint | None, reason: str) -> None:
        """Rank 0: the service's endpoint, or why there is none (the ranks stop waiting)."""
        document = {"url": endpoint.url, "token": endpoint.token} if endpoint else {"error": reason}
        self._store.set(self._prefix + "service", json.dumps(document))

    def endpoint(self, timeout_s: float) -> Endpoint | None:
        """Every other rank: what rank 0 published, waiting at most ``timeout_s``."""
        document = self._read("service", timeout_s, "rank 0 published no service", "spooling to disk")
        if document is None:
            return None
        if "error" in document:
            log.error(
                "runhealth: rank 0 could not start the service (%s); spooling to disk", document["error"]
            )
            return None
        return Endpoint(url=document["url"], token=document["token"])

    def _read(self, name: str, timeout_s: float, missing: str, then: str) -> dict[str, Any] | None:
        """A published document, waiting at most ``timeout_s`` (None, said once, past it)."""
        key = self._prefix + name
        try:
            self._store.wait([key], timedelta(seconds=timeout_s))
            document: dict[str, Any] = json.loads(self._store.get(key))
        except Exception as exc:  # c10d raises its own error types for a timeout or a lost store
            log.error("runhealth: %s in %.0f s (%s); %s", missing, timeout_s, exc, then)
            return None
        return document

    def done(self) -> None:
        """This rank has flushed its records."""
        try:
            self._store.add(self._prefix + "done", 1)
        except Exception as exc:  # the job's store is gone (the launcher tore it down)
            log.warning("runhealth: could not tell rank 0 this rank is done (%s)", exc)

    def finished(self, ranks: int) -> bool:
        return int(self._store.add(self._prefix + "done", 0)) >= ranks

    def publish_relay(self, node: str, url: str | None, reason: str) -> None:
        """Local rank 0: its node's relay (``collectors.relay``), or why there is none."""
        document = {"url": url} if url else {"error": reason}
        self._store.set(f"{self._prefix}relay/{node}", json.dumps(document))

    def relay(self, node: str) -> tuple[bool, str | None]:
        """The node's other ranks, without waiting: whether local rank 0 has published, and
        the relay's URL (None: it did not start, and they send directly)."""
        key = f"{self._prefix}relay/{node}"
        if not self._store.check([key]):
            return False, None
        document = json.loads(self._store.get(key))
        url = document.get("url")
        if not isinstance(url, str) or not url:
            log.warning(
                "runhealth: the node's relay did not start (%s); sending directly", document.get("error")
            )
            return True, None
        return True, url
