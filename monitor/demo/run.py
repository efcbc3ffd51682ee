"""``runhealth demo``: four ranks train a small character-level transformer on the CPU, watched
by runhealth, while two things go wrong.

1. Rank 1 reads a corrupted batch (a bad shard). The loss spikes; runhealth proposes a rollback
   to the newest valid checkpoint before the spike; the replay job reproduces the spike from
   that checkpoint and shows that skipping the batch removes it, so the proposal is redone to
   skip it. The service runs with ``policies.response.spike = hold``, so meanwhile every rank
   holds at one step instead of training on. An operator approves from the CLI with their
   token; the held ranks stop where they hold, restore, skip the batch and resume; the resume
   is checked against the checkpoint and the incident is resolved.
2. Rank 2's device starts computing wrong answers. Its canary (run on every rank at each
   checkpoint) no longer matches its peers', on the immediate re-run too: a persistent
   mismatch, and a proposal to quarantine its node.

Before either, the service itself crashes (SIGKILL) halfway to the bad batch and comes back
on the same port two seconds later: the ranks train on, spool what they cannot send, and
replay it; at the end every window of every rank is in the store, once.

The service runs on loopback over an SQLite file, as the embedded default does; the trainers
record through the RunHealth hook; the operator's steps are the real CLI commands.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from monitor.recovery.decisions import list_proposals
from monitor.store import audit, migrate, queries
from monitor.store.db import create_store_engine, resolve_url

DEMO_DIR = Path("runhealth-demo")


class DemoError(RuntimeError):
    """The demo could not run; the message says where its logs are."""


@dataclass(frozen=True)
class DemoConfig:
    db: str | None = None
    world: int = 4
    corrupt_step: int = 150
    """The update whose batch (on rank 1) is corrupted."""
    faulty_from: int = 150
    """The update from which rank 2's device fails its canaries."""
    checkpoint_every: int = 25
    after_rollback: int = 40
    outage_s: float = 2.0
    """How long the service stays down after it is killed, at ``outage_step``."""
    timeout_s: float = 600.0

    @property
    def outage_step(self) -> int:
        """Halfway to the bad batch: past the warm-up's first checkpoints, well before the spike."""
        return self.corrupt_step // 2

    def __post_init__(self) -> None:
        if self.world < 4:
            raise ValueError("demo --world must be at least 4 (a canary needs a quorum of 3 healthy peers)")
        if self.corrupt_step <= 60:
            raise ValueError("demo --corrupt-step must be past the 50-step warm-up and a checkpoint (> 60)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _environ(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RUNHEALTH_")}
    return {**environ, **extra}


class Demo:
    def __init__(self, config: DemoConfig, console: Console, quiet: bool) -> None:
        self.config = config
        self.console = console
        self.quiet = quiet
        self.db = Path(config.db) if config.db else DEMO_DIR / "runhealth.db"
        self.run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
        self.workdir = self.db.parent / self.run
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []
        self.serves = 0  # ``runhealth serve`` starts (the outage restarts it)

    def _log(self, name: str) -> IO[bytes]:
        """A log file a child writes to; closed by ``stop``."""
        handle = (self.workdir / name).open("ab")
        self.logs.append(handle)
        return handle

    def say(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text)

    # --- the service and the run -------------------------------------------------------------

    def start_service(self) -> str:
        self.engine = create_store_engine(resolve_url(str(self.db), {}))
        migrate.upgrade(self.engine)
        self.port = self._serve(0)
        self.url = f"http://127.0.0.1:{self.port}"
        # serve keeps its admin token in a 0600 file beside the store, named in the discovery
        # file the CLI reads (``runhealth approve ID --db``).
        admin = Path(f"{self.db}.admin-token").read_text().strip()
        response = httpx.post(
            f"{self.url}/v1/runs",
            json={"name": self.run},
            headers={"authorization": f"Bearer {admin}"},
            timeout=30,
        )
        response.raise_for_status()
        self.token = response.json()["token"]
        return self.url

    def _serve(self, port: int) -> int:
        """Start ``runhealth serve`` on ``port`` (0: a free one); the port it bound."""
        self.serves += 1
        port_file = self.workdir / f"port-{self.serves}"
        command = [
            sys.executable,
            "-m",
            "monitor",
            "serve",
            "--db",
            str(self.db),
            "--port",
            str(port),
            "--port-file",
            str(port_file),
        ]
        log = self._log("serve.log")
        # The spike's proposal holds the run until it is decided (``policies.responses``). A
        # window waits up to 13 s (not 5) for a rank still to report: rank 2 runs its canary
        # re-runs on the failing device at the bad batch's step, and on a loaded machine its
        # records came more than 5 s late. The bad batch's rank was then judged against 2 peers
        # instead of 3, a warning instead of a critical spike, and nothing was held.
        environ = _environ(
            RUNHEALTH_POLICIES__RESPONSE__SPIKE="hold",
            RUNHEALTH_POLICIES__READINESS__WATERMARK_SLACK_S="9",  # 2 flushes of 2 s + 9 s
            RUNHEALTH_POLICIES__READINESS__WATERMARK_S="13",  # a hook that states no flush interval
        )
        self.service = subprocess.Popen(command, env=environ, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.service.poll() is not None or time.monotonic() > deadline:
                raise DemoError(f"runhealth serve did not start: see {self.workdir / 'serve.log'}")
            time.sleep(0.05)
        return int(port_file.read_text().strip())

    def outage(self) -> dict[str, Any]:
        """The service crashes once the ranks pass ``outage_step`` and is back on the same port
        ``outage_s`` later; the ranks never stop training."""
        step = self.config.outage_step
        self.wait(f"step {step}", lambda: self._stored_step() >= step)
        self.service.kill()  # SIGKILL: no shutdown, requests in flight cut off
        self.service.wait(15)
        killed, at_step = time.monotonic(), self._stored_step()
        time.sleep(self.config.outage_s)
        self._serve(self.port)
        down_s = time.monotonic() - killed
        self.say(
            f"[bold]outage[/bold]: runhealth serve killed (SIGKILL) at step {at_step}, serving again "
            f"{down_s:.1f} s later; the ranks trained on and spooled what they could not send"
        )
        return {"killed_at_step": at_step, "down_s": down_s}

    def _stored_step(self) -> int:
        with self.engine.connect() as connection:
            found = connection.execute(
                sa.text(
                    "SELECT MAX(s.step) FROM step_records s JOIN runs r ON r.id = s.run_id WHERE r.name = :run"
                ),
                {"run": self.run},
            ).scalar()
        return int(found or 0)

    def stored_windows(self, results: list[dict[str, Any]]) -> dict[str, int]:
        """Every rank's windows against the store: stored once each (the store's key), and
        how many of the attempts a rank made are missing from it, or stored though not made."""
        with self.engine.connect() as connection:
            rows = connection.execute(
                sa.text(
                    "SELECT s.incarnation, s.rank, s.attempt FROM step_records s "
                    "JOIN runs r ON r.id = s.run_id WHERE r.name = :run"
                ),
                {"run": self.run},
            ).all()
            late = connection.execute(
                sa.text(
                    "SELECT COALESCE(SUM(s.late_records), 0) FROM step_summaries s "
                    "JOIN runs r ON r.id = s.run_id WHERE r.name = :run"
                ),
                {"run": self.run},
            ).scalar_one()
        stored = {(row.incarnation, row.rank, row.attempt) for row in rows}
        ended = [
            (result["rank"], incarnation["incarnation"], int(incarnation["attempts"]))
            for result in results
            for incarnation in [*result["rollbacks"], {**result, "attempts": result["progress"]["attempt"]}]
        ]
        made = {
            (incarnation, rank, attempt)
            for rank, incarnation, attempts in ended
            for attempt in range(1, attempts + 1)
        }
        return {
            "windows": len(made),
            "stored": len(rows),
            "lost": len(made - stored),
            "unexpected": len(stored - made),
            "late_records": int(late),  # arrived after their window was judged without them
        }

    def launch(self) -> None:
        corrupt = f"1:{self.config.corrupt_step - 1}"
        replay = f"{sys.executable} -m monitor.demo.replay --task text --world {self.config.world} --corrupt {corrupt} {{spec}} {{result}}"
        port = str(_free_port())
        (self.workdir / "results").mkdir(exist_ok=True)
        for rank in range(self.config.world):
            environ = _environ(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                WORLD_SIZE=str(self.config.world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(self.config.world),  # one machine: the ranks share a relay
                OMP_NUM_THREADS="1",
                RUNHEALTH_URL=self.url,
                RUNHEALTH_TOKEN=self.token,
                RUNHEALTH_RUN=self.run,
                RUNHEALTH_NODE=f"node-{rank}",
                RUNHEALTH_SPOOL_DIR=str(self.workdir / "spool"),
            )
            command = [
                sys.executable,
                "-m",
                "monitor.demo.worker",
                "--task",
                "text",
                "--wait-rollback",
                "--steps",
                str(self.config.corrupt_step),
                "--max-steps",
                str(self.config.corrupt_step * 5),
                "--after-rollback",
                str(self.config.after_rollback),
                "--checkpoint-every",
                str(self.config.checkpoint_every),
                "--checkpoints",
                str(self.workdir / "ckpt"),
                "--corrupt",
                corrupt,
                "--faulty-rank",
                "2",
                "--faulty-from",
                str(self.config.faulty_from),
                "--replay-command",
                replay,
                "--out",
                str(self.workdir / "results"),
            ]
            log = self._log(f"rank-{rank}.log")
            self.processes.append(subprocess.Popen(command, env=environ, stdout=log, stderr=log))

    # --- the operator ------------------------------------------------------------------------

    def cli(self, *args: str) -> dict[str, Any]:
        """A real ``runhealth`` command, as the operator would type it."""
        self.say(f"  [dim]$ runhealth {' '.join(args)}[/dim]")
        done = subprocess.run(
            [sys.executable, "-m", "monitor", *args, "--json"],
            capture_output=True,
            text=True,
            env=_environ(),
            timeout=600,
        )
        if done.returncode != 0:
            raise DemoError(f"runhealth {args[0]} failed: {done.stderr.strip()[-500:]}")
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    def proposals(self) -> list[dict[str, Any]]:
        with self.engine.connect() as connection:
            return list_proposals(connection, self.run)

    def wait(self, what: str, check: Any) -> Any:
        deadline = time.monotonic() + self.config.timeout_s
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            if any(p.poll() not in (None, 0) for p in self.processes):
                raise DemoError(f"a rank failed while waiting for {what}: see {self.workdir}/rank-*.log")
            time.sleep(0.3)
        raise DemoError(f"timed out waiting for {what}")

    def recover(self) -> dict[str, Any]:
        first = self.wait(
            "the spike's proposal",
            lambda: next(
                (
                    p
                    for p in self.proposals()
                    if p["status"] == "pending" and p["evidence"]["incident"]["kind"] == "spike"
                ),
                None,
            ),
        )
        incident = first["evidence"]["incident"]
        self.say(f"[bold]incident {first['incident']}[/bold]: {incident['summary']}")
        self.say(
            f"  proposal {first['id']}: rewind to the checkpoint at step {first['target']['step']} "
            f"({first['verdict']}: {first['evidence']['diagnosis']['reason']})"
        )
        self.hold = self.wait("every rank holding", lambda: self._held(first["incident"]))
        self.say(
            f"  hold: every rank paused at step {self.hold['at_step']} "
            f"({self.hold['at_step'] - incident['first_step']} steps after the bad batch) until the "
            "proposal is decided (policies.response.spike = hold)"
        )
        replayed = self.cli("replay", str(first["incident"]), "--db", str(self.db))
        self.say(f"  replay job: [bold]{replayed['verdict']}[/bold] ({replayed['reason']})")
        second = self.wait(
            "the re-proposal",
            lambda: next((p for p in self.proposals() if p["id"] == replayed.get("proposal")), None),
        )
        self.say(
            f"  proposal {second['id']}: rewind to step {second['target']['step']}, skip {second['skip_batches']}, "
            f"cost {second['cost_steps']} steps"
        )
        # No URL and no token: the CLI finds the service through the store's discovery file.
        approved = self.cli(
            "approve", str(second["id"]), "--reason", "bad shard, skip it", "--db", str(self.db)
        )
        self.say(
            f"  {approved['message']}; the hold is released on approval: every held rank stops where "
            f"it holds (step {self.hold['at_step']}) instead of at step "
            f"{self._directive_step(approved['proposal']['directive'])}"
        )
        found: dict[str, Any] = second
        return found

    def _held(self, incident: int) -> dict[str, Any] | None:
        """The incident's hold once every rank acknowledged it: the step they hold at."""
        with self.engine.connect() as connection:
            rows = connection.execute(
                sa.text(
                    "SELECT a.rank, a.step FROM directive_acks a JOIN directives d ON d.id = a.directive_id "
                    "WHERE d.kind = 'hold' AND d.incident_id = :i"
                ),
                {"i": incident},
            ).all()
        if len({row.rank for row in rows}) < self.config.world:
            return None
        return {"at_step": max(row.step for row in rows), "ranks": len(rows)}

    def hold_release(self, incident: int) -> str | None:
        """Why the incident's hold ended (``hold_released`` in its story)."""
        with self.engine.connect() as connection:
            for entry in audit.story(connection, incident):
                if entry["action"] == "hold_released":
                    return str(entry["details"].get("reason"))
        return None

    def _directive_step(self, directive_id: int) -> int:
        with self.engine.connect() as connection:
            return int(
                connection.execute(
                    sa.text("SELECT act_at_step FROM directives WHERE id = :i"), {"i": directive_id}
                ).scalar_one()
            )

    def finish(self) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.config.timeout_s
        for process in self.processes:
            try:
                process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise DemoError(f"the ranks did not finish: see {self.workdir}/rank-*.log") from exc
        if any(p.returncode != 0 for p in self.processes):
            raise DemoError(f"a rank failed: see {self.workdir}/rank-*.log")
        return [
            json.loads((self.workdir / "results" / f"rank-{r}.json").read_text())
            for r in range(self.config.world)
        ]

    def stop(self) -> None:
        for process in [*self.processes, getattr(self, "service", None)]:
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)
        for handle in self.logs:
            handle.close()
        if hasattr(self, "engine"):
            self.engine.dispose()


def run_demo(config: DemoConfig, console: Console, quiet: bool = False) -> dict[str, Any]:
    demo = Demo(config, console, quiet)
    started = time.time()
    try:
        url = demo.start_service()
        demo.say(
            f"[bold]runhealth demo[/bold]: {config.world} ranks (gloo, CPU) train a character-level "
            f"transformer on the Python standard library's source; runhealth serves on {url} over {demo.db}."
        )
        demo.say(
            f"  planted: rank 1's batch at update {config.corrupt_step} is noise; rank 2's device fails "
            f"from update {config.faulty_from} on."
        )
        demo.launch()
        outage = demo.outage()
        recovered = demo.recover()
        results = demo.finish()
        # Canary rounds and the resume check land within a moment of the ranks' last records.
        demo.wait("the canary's verdict", lambda: any(p["verdict"] == "hardware" for p in demo.proposals()))
        return report(demo, recovered, results, outage, time.time() - started)
    finally:
        demo.stop()


def report(
    demo: Demo,
    recovered: dict[str, Any],
    results: list[dict[str, Any]],
    outage: dict[str, Any],
    seconds: float,
) -> dict[str, Any]:
    with demo.engine.connect() as connection:
        incidents = queries.list_incidents(connection, queries.IncidentFilter(run=demo.run))
        story = queries.get_incident(connection, recovered["incident"])
        chain = audit.verify(connection)
    proposals = demo.proposals()
    stopped = sorted({r["rollbacks"][0]["stopped_at"] for r in results if r["rollbacks"]})
    hardware = next(p for p in proposals if p["verdict"] == "hardware")
    windows = demo.stored_windows(results)
    spooled = sum(r["counters"]["spooled"] for r in results)
    replayed = sum(r["counters"]["replayed"] for r in results)
    outage = {**outage, **windows, "spooled": spooled, "replayed": replayed}
    intact = not windows["lost"] and not windows["unexpected"]
    demo.say(
        f"[bold]the outage {'lost nothing' if intact else 'LOST RECORDS'}[/bold]: "
        f"{spooled} records spooled, {replayed} replayed; "
        f"{windows['stored']} of the ranks' {windows['windows']} windows stored, each once "
        f"({windows['lost']} missing)"
    )
    demo.say(
        f"  every rank stopped at step {stopped}, restored step {recovered['target']['step']}, skipped "
        f"{recovered['skip_batches']} and resumed; incident {recovered['incident']}: [bold]{story['status']}[/bold]"
    )
    relayed = results[0]["counters"]  # local rank 0 runs the node's relay
    per_request = relayed["relay_batches"] / max(1, relayed["relay_posts"])
    demo.say(
        f"[bold]node relay[/bold] (rank 0): the {demo.config.world} ranks' {relayed['relay_batches']} batches "
        f"reached the service in {relayed['relay_posts']} requests ({per_request:.1f} a request)"
    )
    readers = results[0]["readers"]  # rank 0 reads for the node: these are CPU ranks
    demo.say(
        f"[bold]device and link readers[/bold] (rank 0): NVML {readers['nvml']}; links {readers['links']}"
    )
    hold = {**demo.hold, "released": demo.hold_release(recovered["incident"])}
    demo.say(
        f"[bold]hold[/bold]: held at step {hold['at_step']} and released on {hold['released']}: "
        f"every rank stopped at step {stopped} ({hold['at_step'] - recovered['evidence']['incident']['first_step']} "
        "steps after the bad batch)"
    )
    demo.say(
        f"[bold]canary[/bold]: rank 2's device ({hardware['quarantine']['node']}) missed its peers' fingerprints "
        f"on the re-run too: proposal {hardware['id']} quarantines {hardware['quarantine']['node']} "
        f"(awaiting approval; actions are dry-run until configured live)"
    )
    if not demo.quiet:
        demo.console.print(
            _table(
                "Incidents",
                ["id", "kind", "severity", "status", "first step", "ranks", "summary"],
                [
                    [
                        i["id"],
                        i["kind"],
                        i["severity"],
                        i["status"],
                        i["first_step"],
                        i["ranks"],
                        i["summary"],
                    ]
                    for i in incidents
                ],
            )
        )
        demo.console.print(
            _table(
                "Proposals",
                ["id", "incident", "status", "action", "verdict", "rewind to", "quarantine", "decided by"],
                [
                    [
                        p["id"],
                        p["incident"],
                        p["status"],
                        p["action"],
                        p["verdict"],
                        p["target"]["step"],
                        p["quarantine"]["node"],
                        p["decided_by"],
                    ]
                    for p in proposals
                ],
            )
        )
        demo.console.print(
            _table(
                f"Incident {recovered['incident']}: the story",
                ["#", "who", "what", "why"],
                [[e["seq"], e["actor"], e["action"], (e["reason"] or "")[:90]] for e in story["story"]],
            )
        )
    goodput = demo.cli("goodput", demo.run, "--db", str(demo.db))
    demo.say(_goodput_line(goodput))
    demo.say(
        f"audit chain {'intact' if chain.ok else 'BROKEN'}: {chain.entries} entries. "
        f"{seconds:.0f} s. Explore: runhealth incidents --db {demo.db}; runhealth proposals --db {demo.db}; "
        f"runhealth incident {recovered['incident']} --db {demo.db}; runhealth audit verify --db {demo.db}"
    )
    return {
        "run": demo.run,
        "db": str(demo.db),
        "seconds": seconds,
        "incidents": incidents,
        "proposals": proposals,
        "recovered_incident": story["status"],
        "stopped_at": stopped,
        "audit_ok": chain.ok,
        "story": [e["action"] for e in story["story"]],
        "outage": outage,
        "hold": hold,
        "readers": readers,
        "relay": {"requests": relayed["relay_posts"], "batches": relayed["relay_batches"]},
        "goodput": goodput,
    }


def _goodput_line(goodput: dict[str, Any]) -> str:
    """Where the run's wall time went, largest badput first, and the interval advice."""
    ratio = goodput["goodput_ratio"]
    lost = sorted(
        (c for c in goodput["categories"] if c["cause"] != "productive" and c["share"]),
        key=lambda c: -c["share"],
    )
    causes = ", ".join(f"{c['label']} {100 * c['share']:.1f}%" for c in lost[:4])
    advised = goodput["interval"]["advised"]
    advice = (
        f"; checkpoint every {advised['interval_s']:.0f} s (Young/Daly), not {goodput['interval']['current']['interval_s']:.1f} s"
        if advised and goodput["interval"]["current"]
        else ""
    )
    productive = "unknown" if ratio is None else f"{100 * ratio:.1f}%"
    return f"[bold]goodput[/bold]: {productive} of {goodput['wall_s']:.0f} s productive; {causes}{advice}"


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    view = Table(title=title, title_justify="left")
    for column in columns:
        view.add_column(column)
    for row in rows:
        view.add_row(*["" if v is None else str(v) for v in row])
    return view
