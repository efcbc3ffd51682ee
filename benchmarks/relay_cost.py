"""What a node relay costs the process that runs it (local rank 0, a training process).

Three processes: a stand-in service (answers every batch 200 with no directives, so only the
relay's own work is measured), the relay (``collectors.relay.NodeRelay``, as local rank 0 runs
it), and the node's ranks (``--ranks`` threads, each posting its batch of ``--records`` step
records through a ``RelayTransport`` every round, together, as the flush grid makes them). It
prints as JSON the relay process's CPU (``/proc``) per round and per relayed rank batch, the
upstream posts per round, and a rank's time from post to answer.

    python benchmarks/relay_cost.py --ranks 8 --rounds 300
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectors.counters import Counters
from collectors.relay import NodeRelay, RelayConfig, RelayLookup, RelayTransport
from collectors.transport import TransportConfig

TICKS = os.sysconf("SC_CLK_TCK")
TOKEN = "rh_run_bench"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def serve_upstream(port: Any, ready: Any) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            body = b'{"accepted":1,"duplicates":0,"by_kind":{},"directives_by_rank":{}}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port.value = server.server_address[1]
    ready.set()
    server.serve_forever()


def run_relay(upstream_port: int, ranks: int, url: Any, ready: Any, stop: Any) -> None:
    config = TransportConfig(url=f"http://127.0.0.1:{upstream_port}", token=TOKEN, run="bench")
    relay = NodeRelay(RelayConfig(), config, ranks, Counters())
    url.value = relay.start().encode()
    ready.set()
    stop.wait()
    relay.stop()


def step(rank: int, attempt: int) -> dict[str, Any]:
    return {"kind": "step", "incarnation": "inc", "rank": rank, "attempt": attempt, "step": attempt,
            "time": 1.7e9 + attempt, "tokens": 4096, "loss_sum": 9000.5, "grad_norm": 1.25,
            "lr": 3e-4, "forward_s": 0.01, "backward_s": 0.02, "optimizer_s": 0.003,
            "data_wait_s": 0.0004, "node": "n0", "dp_rank": rank}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--records", type=int, default=2, help="step records per rank batch")
    args = parser.parse_args()
    port, up_ready = multiprocessing.Value("i", 0), multiprocessing.Event()
    upstream = multiprocessing.Process(target=serve_upstream, args=(port, up_ready), daemon=True)
    upstream.start()
    up_ready.wait(30)
    url, ready, stop = multiprocessing.Array("c", 64), multiprocessing.Event(), multiprocessing.Event()
    relay = multiprocessing.Process(
        target=run_relay, args=(port.value, args.ranks, url, ready, stop), daemon=True
    )
    relay.start()
    ready.wait(30)
    assert relay.pid is not None and upstream.pid is not None
    config = TransportConfig(url=f"http://127.0.0.1:{port.value}", token=TOKEN, run="bench")
    counters = Counters()
    transports = [
        RelayTransport(RelayLookup.known(url.value.decode()), config, RelayConfig(), counters)
        for _ in range(args.ranks)
    ]
    waits: list[float] = []
    lock = threading.Lock()

    def post(rank: int, attempt: int, barrier: threading.Barrier) -> None:
        batch = [step(rank, attempt + k) for k in range(args.records)]
        barrier.wait()
        started = time.perf_counter()
        delivery = transports[rank].post(batch)
        assert delivery.status == 200, delivery
        with lock:
            waits.append(time.perf_counter() - started)

    for attempt in range(5):  # connections made, threads warm
        run_round(args.ranks, attempt * args.records, post)
    before = cpu_s(relay.pid)
    began = time.perf_counter()
    for round_ in range(args.rounds):
        run_round(args.ranks, (5 + round_) * args.records, post)
    wall = time.perf_counter() - began
    used = cpu_s(relay.pid) - before
    stop.set()
    relay.join(15)
    upstream.kill()
    waits = waits[5 * args.ranks :]
    print(json.dumps({
        "ranks": args.ranks, "rounds": args.rounds, "records_per_rank_batch": args.records,
        "relay_cpu_ms_per_round": round(1000 * used / args.rounds, 3),
        "relay_cpu_us_per_rank_batch": round(1e6 * used / (args.rounds * args.ranks), 1),
        "relay_cpu_share_at_2s_flush": round(used / args.rounds / 2.0, 5),
        "rank_post_to_answer_ms": {"p50": round(1000 * statistics.median(waits), 2),
                                    "p99": round(1000 * sorted(waits)[int(0.99 * len(waits))], 2)},
        "wall_s": round(wall, 2), "load_average": os.getloadavg()[0],
        "bypassed": counters.snapshot()["relay_bypassed"],
    }, indent=2))  # fmt: skip


def run_round(ranks: int, attempt: int, post: Any) -> None:
    barrier = threading.Barrier(ranks)
    threads = [threading.Thread(target=post, args=(rank, attempt, barrier)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


if __name__ == "__main__":
    main()
