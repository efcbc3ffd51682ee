"""A real Prometheus and a real ``runhealth serve``, each a process the tests start and stop.

Prometheus runs once per session (``conftest.prometheus_server``): it evaluates the deployed
rule files every second and scrapes whatever targets a test registers through file-based
service discovery, so tests share one server without restarting it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import httpx

from tests.support import _alive, _wait_gone, free_port, require_binary

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"


class PrometheusServer:
    """Prometheus on 127.0.0.1 with its own storage under ``root``; scrape and rule evaluation
    every ``interval_s``."""

    def __init__(self, root: Path, rule_files: Sequence[Path], interval_s: float = 1.0) -> None:
        self.root = root
        self.rule_files = list(rule_files)
        self.interval_s = interval_s
        self.targets = root / "targets"
        self.config = root / "prometheus.yml"
        self.log = root / "prometheus.log"
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log_handle: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        binary = require_binary("prometheus")
        self.targets.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.port = free_port()
            self._write_config()
            self._log_handle = self.log.open("ab")
            self.process = subprocess.Popen(
                [
                    str(binary),
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1d",
                    "--log.level=warn",
                ],
                stdout=self._log_handle,
                stderr=subprocess.STDOUT,
                cwd=self.root,
            )
            if self._wait_ready(timeout_s):
                return
            self.stop()
        raise RuntimeError(f"Prometheus did not start; see {self.log}")

    def stop(self) -> None:
        """Stop the server by its PID, and make sure it is gone."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def set_targets(self, job: str, targets: Sequence[str], labels: Mapping[str, str] | None = None) -> None:
        """Point ``job`` at ``targets`` (file discovery: Prometheus notices within a second)."""
        path = self.targets / f"{job}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": list(targets), "labels": dict(labels or {})}]))
        tmp.replace(path)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result; raises on a parse or evaluation error."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/api/v1/alerts", timeout=10).json()
        alerts: list[dict[str, Any]] = body["data"]["alerts"]
        return alerts

    def _write_config(self) -> None:
        interval = f"{self.interval_s:g}s"
        jobs = ("runhealth",)
        config = {
            "global": {
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "evaluation_interval": interval,
            },
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [
                {
                    "job_name": job,
                    "file_sd_configs": [
                        {"files": [str(self.targets / f"{job}.json")], "refresh_interval": "1s"}
                    ],
                }
                for job in jobs
            ],
        }
        for job in jobs:
            if not (self.targets / f"{job}.json").exists():
                self.set_targets(job, [])
        self.config.write_text(json.dumps(config, indent=2))  # JSON is YAML

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return False


class ServeProcess:
    """``runhealth serve`` in a subprocess over an SQLite file, as an operator starts it."""

    def __init__(self, root: Path, admin_token: str, environ: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.admin_token = admin_token
        self.environ = dict(os.environ if environ is None else environ)
        self.port_file = root / "port"
        self.log = root / "serve.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self, timeout_s: float = 60.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        environ = {**self.environ, "RUNHEALTH_ADMIN_TOKEN": self.admin_token}
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "monitor",
                    "serve",
                    "--db",
                    str(self.root / "runhealth.db"),
                    "--port",
                    "0",
                    "--port-file",
                    str(self.port_file),
                ],
                env=environ,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"runhealth serve did not start; see {self.log}")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text().strip())

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if _alive(process.pid):
            _wait_gone(process.pid)
