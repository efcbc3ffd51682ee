"""No window lost without a trace (issue 17, item 1), as a property: random values of every
field a trainer hands the hook, of every type and size it accepts, through the hook's public
API (``window_start``/``loss``/``grad_norm``/``window_end`` and ``rh.windows(...)``, with an
optimizer's learning rate and a GradScaler's scale) against a real ``runhealth serve`` on
SQLite. After ``close`` each window the hook opened is in exactly one place: stored in
``step_records``, left in the spool, or in the dead-letter file with a reason. ``hook_errors``
may count a failure; it never stands for a lost window. The service is up throughout, so a
window left in the spool would mean it answered a server error: that is checked too.

A second property draws only values a trainer plausibly hands over (any float, NaN and
infinities included, 0-d float tensors, counts in range, ids of any size or text): every such
window is stored, none refused. The tests after them are the regressions of what the first
property found."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st

from collectors import HookConfig, ReadersConfig, RunHealth, RunHealthConfig
from collectors.config import ConfigError
from collectors.counters import Counters
from collectors.sender import Sender, SenderConfig
from collectors.spool import DEAD_SUFFIX, SPOOL_SUFFIX, Spool, SpoolConfig, safe_name
from collectors.transport import Delivery, HttpTransport, Outcome, TransportConfig
from collectors.wire import Record, decode_line
from policies.protocol import RUN_NAME, value_problem
from tests.collectors_support import RecordingTransport, ServeProcess, serving, step_rows
from tests.support import require_module

require_module("torch")  # before the import: skipped without torch, failed in CI

import torch  # noqa: E402

# Bounded and derandomized: the same examples on every machine; on 2 cores about 15 s for both
# properties, plus 5 s to start the service.
EXAMPLES = 60
PLAUSIBLE_EXAMPLES = 25
SETTINGS = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no explain phase: a minute of reruns
)

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
EDGE_INTS = (
    0,
    1,
    -1,
    2**31 - 1,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    -(2**63) - 1,
    2**128,
    10**400,
)
EDGE_FLOATS = (0.0, -0.0, math.inf, -math.inf, math.nan, 1e308, -1e308, 5e-324, 1e-45, 2.0**63, 2.0**64, 1e30)

ints = st.integers() | st.sampled_from(EDGE_INTS)
floats = st.floats() | st.sampled_from(EDGE_FLOATS)


@st.composite
def scalar_tensors(
    draw: st.DrawFn, dtypes: Sequence[torch.dtype] = (*FLOAT_DTYPES, *INT_DTYPES, torch.bool)
) -> torch.Tensor:
    """A 0-d tensor of one of ``dtypes``, its value anywhere that dtype reaches (a float one
    sometimes requiring grad, as a loss does)."""
    dtype = draw(st.sampled_from(dtypes))
    if dtype is torch.bool:
        return torch.tensor(draw(st.booleans()))
    if dtype.is_floating_point:
        tensor = torch.tensor(draw(floats), dtype=dtype)
        return tensor.requires_grad_() if draw(st.booleans()) else tensor
    info = torch.iinfo(dtype)
    return torch.tensor(draw(st.integers(info.min, info.max)), dtype=dtype)


@st.composite
def id_lists(draw: st.DrawFn, ids: st.SearchStrategy[Any]) -> Any:
    """Sample ids as a trainer hands them: none, a list, a tuple, an int64 tensor."""
    kind = draw(st.sampled_from(["none", "list", "tuple", "tensor"]))
    if kind == "none":
        return None
    if kind == "tensor":
        return torch.tensor(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6)), dtype=torch.int64)
    items = draw(st.lists(ids, max_size=6))
    return tuple(items) if kind == "tuple" else items


@st.composite
def labels(draw: st.DrawFn, shapes: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """Labels as a causal LM's: rows of token ids with -100 where nothing is supervised."""
    shape = draw(st.sampled_from(shapes))
    size = math.prod(shape)
    flat = draw(st.lists(st.sampled_from([-100, 0, 3, 31]), min_size=size, max_size=size))
    return torch.tensor(flat, dtype=torch.long).reshape(shape)


@dataclass(frozen=True)
class Draws:
    """What each value a trainer hands the hook is drawn from."""

    loss: st.SearchStrategy[Any]
    tokens: st.SearchStrategy[Any]
    labels: st.SearchStrategy[Any]
    sample_id: st.SearchStrategy[Any]
    examples: st.SearchStrategy[Any]
    data_wait_s: st.SearchStrategy[Any]
    grad_norm: st.SearchStrategy[Any]
    lr: st.SearchStrategy[Any]
    init_scale: st.SearchStrategy[Any]
    ids_fail: st.SearchStrategy[bool]


# A number as a trainer may hand one: a float, an int of any size, a 0-d tensor of any dtype;
# now and then something no trainer should pass (the signatures take ``Any``).
numbers = floats | ints | scalar_tensors()
oddities = st.sampled_from([None, "1.5", "loss", b"2", [1.0], torch.tensor([1.0, 2.0]), torch.zeros(0)])
EVERY = Draws(
    loss=numbers | oddities,
    tokens=st.none() | numbers,
    labels=st.none() | labels([(), (0, 4), (1, 1), (2, 5), (3, 9)]),
    sample_id=(
        ints
        | st.text(st.characters(codec=None), max_size=12)  # lone surrogates included
        | st.text(min_size=190, max_size=230)  # around the service's 200 characters
        | st.binary(max_size=8)
        | st.none()
        | floats
        | st.booleans()
    ),
    examples=st.none() | numbers,
    data_wait_s=st.none() | numbers,
    grad_norm=numbers | oddities,
    lr=st.none() | floats | ints,
    init_scale=st.none() | floats | ints,
    ids_fail=st.sampled_from([False] * 7 + [True]),  # the trainer's ``sample_ids`` raises
)
PLAUSIBLE = Draws(
    loss=st.floats() | st.integers(-(2**53), 2**53) | scalar_tensors(FLOAT_DTYPES),
    tokens=st.none()
    | st.integers(0, 2**40)
    | st.builds(torch.tensor, st.integers(0, 2**40), dtype=st.sampled_from([torch.int64, torch.float64])),
    labels=st.none() | labels([(0, 4), (1, 1), (2, 5), (3, 9)]),
    sample_id=st.integers() | st.text(st.characters(codec="utf-8"), max_size=200),
    examples=st.none() | st.integers(0, 2**20),
    data_wait_s=st.none() | st.floats(),
    grad_norm=st.floats() | scalar_tensors(FLOAT_DTYPES),
    lr=st.none() | st.floats(),
    init_scale=st.none() | st.floats(),
    ids_fail=st.sampled_from([False] * 7 + [True]),
)


@dataclass
class Microbatch:
    loss: Any
    labels: Any = None
    tokens: Any = None
    reduction: str = "mean"


@dataclass
class Window:
    sample_ids: Any = None
    examples: Any = None
    data_wait_s: Any = None
    microbatches: list[Microbatch] = field(default_factory=list)
    grad_norm: Any = None
    call_grad_norm: bool = False
    step: bool = True
    ids_fail: bool = False

    def ids(self) -> Any:
        """The trainer's ``sample_ids`` function (``rh.windows``), which may raise."""
        if self.ids_fail:
            raise KeyError("ids")
        return self.sample_ids


@dataclass
class Training:
    """One attach-train-close of the hook: its run, what it watches, and its windows."""

    run_name: str
    windows: list[Window]
    loop: str  # "calls": window_start ... window_end; "iterator": rh.windows(...)
    microbatches_per_window: int
    lr: Any  # an SGD optimizer's rate (set as is), or None for no optimizer
    init_scale: Any  # a GradScaler's, or None for none
    max_sample_ids: int
    batch_records: int


FOLDED = 65  # more microbatches than the hook keeps apart in a window: it folds them
run_names = st.from_regex(RUN_NAME.pattern or "", fullmatch=True).map(lambda name: name[:60]) | st.text(
    max_size=20
)


def trainings(draws: Draws) -> st.SearchStrategy[Training]:
    microbatch = st.builds(
        Microbatch,
        loss=draws.loss,
        labels=draws.labels,
        tokens=draws.tokens,
        reduction=st.sampled_from(["mean", "sum"]),
    )
    window = st.builds(
        Window,
        sample_ids=id_lists(draws.sample_id),
        examples=draws.examples,
        data_wait_s=draws.data_wait_s,
        microbatches=st.lists(microbatch, max_size=3)
        | st.tuples(microbatch, st.just(FOLDED)).map(lambda repeated: [repeated[0]] * repeated[1]),
        grad_norm=draws.grad_norm,
        call_grad_norm=st.booleans(),
        step=st.booleans(),
        ids_fail=draws.ids_fail,
    )
    return st.builds(
        Training,
        run_name=run_names,
        windows=st.integers(1, 8).flatmap(lambda n: st.lists(window, min_size=n, max_size=n)),
        loop=st.sampled_from(["calls", "iterator"]),
        microbatches_per_window=st.integers(1, 2),
        lr=draws.lr,
        init_scale=draws.init_scale,
        max_sample_ids=st.sampled_from([0, 2, 4096]),
        batch_records=st.integers(1, 8),
    )


@dataclass
class Where:
    """Where each window of one incarnation ended up, by attempt."""

    stored: list[int] = field(default_factory=list)
    spooled: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def places(self) -> collections.Counter[int]:
        return collections.Counter([*self.stored, *self.spooled, *self.dead])


class Harness:
    """The module's one service, the runs made on it, a fresh spool directory per training."""

    def __init__(self, serve: ServeProcess, root: Path) -> None:
        self.serve = serve
        self.root = root
        self.tokens: dict[str, str] = {}
        self.count = itertools.count()

    def token(self, run: str) -> str:
        if run not in self.tokens:
            self.tokens[run] = self.serve.create_run(run)
        return self.tokens[run]

    def config(self, training: Training, run: str) -> RunHealthConfig:
        return RunHealthConfig(
            transport=TransportConfig(url=self.serve.url, token=self.token(run)),  # run: environ
            spool=SpoolConfig(directory=str(self.root / f"spool-{next(self.count)}"), fsync=False),
            sender=SenderConfig(
                flush_interval_s=0.05,
                heartbeat_interval_s=60.0,
                batch_records=training.batch_records,
                close_timeout_s=3.0,
                retry_initial_s=0.05,
            ),
            readers=ReadersConfig(nvml=False, links=False),
            hook=HookConfig(max_sample_ids=training.max_sample_ids),
        )

    def where(self, run: str, incarnation: str, spool_directory: Path) -> Where:
        found = Where()
        found.stored = [
            r["attempt"] for r in step_rows(self.serve.db, run) if r["incarnation"] == incarnation
        ]
        directory = spool_directory / safe_name(run)
        for path in sorted(directory.glob(f"*{SPOOL_SUFFIX}")) if directory.exists() else []:
            if path.name.endswith(DEAD_SUFFIX):
                for entry in read_lines(path, 0):
                    found.reasons.append(entry["reason"])
                    found.dead += attempts(entry["records"], incarnation)
            else:
                cursor = path.with_name(path.name + ".cursor")
                offset = int(cursor.read_text() or 0) if cursor.exists() else 0
                for entry in read_lines(path, offset):
                    found.spooled += attempts(entry["records"], incarnation)
        return found


def read_lines(path: Path, offset: int) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as handle:
        handle.seek(offset)
        for line in handle:
            yield decode_line(line)


def attempts(records: list[dict[str, Any]], incarnation: str) -> list[int]:
    return [r["attempt"] for r in records if r.get("kind") == "step" and r.get("incarnation") == incarnation]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    root = tmp_path_factory.mktemp("no-silent-loss")
    with serving(root) as serve:
        yield Harness(serve, root)


RENAMED = "renamed-run"


def run_name(drawn: str) -> str:
    """The run the hook records under when ``RUNHEALTH_RUN`` is ``drawn``: the name itself
    (stripped) when the service takes it. Otherwise the hook must refuse it at once, before any
    window (the trainer sees the error), and the training goes on under another name."""
    name = drawn.strip()
    if name and value_problem(RUN_NAME, name) is None:
        return name
    if name:
        with pytest.raises(ConfigError, match="RUNHEALTH_RUN"):
            RunHealth(environ={"RUNHEALTH_RUN": drawn})
    return RENAMED


def train(rh: RunHealth, training: Training, optimizer: Any) -> int:
    """Runs the training's windows through the hook; returns how many windows it opened."""

    def one(window: Window) -> None:
        for microbatch in window.microbatches:
            rh.loss(microbatch.loss, labels=microbatch.labels, tokens=microbatch.tokens,
                    reduction=microbatch.reduction)  # type: ignore[arg-type]  # fmt: skip
        if window.call_grad_norm:
            rh.grad_norm(window.grad_norm)
        if optimizer is not None and window.step:
            optimizer.step()

    if training.loop == "iterator":
        per = training.microbatches_per_window
        for window in rh.windows(training.windows, sample_ids=Window.ids, microbatches=per):
            one(window)
        return math.ceil(len(training.windows) / per)
    for window in training.windows:
        rh.window_start(
            sample_ids=window.sample_ids, examples=window.examples, data_wait_s=window.data_wait_s
        )
        one(window)
        rh.window_end()
    return len(training.windows)


def run_training(harness: Harness, training: Training) -> Where:
    """Trains through a hook against the module's service; where each window it opened went,
    checked to be exactly one place for each."""
    note(repr(training))
    run = run_name(training.run_name)
    config = harness.config(training, run)
    model = optimizer = scaler = None
    if training.lr is not None:
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.param_groups[0]["lr"] = training.lr  # any value: the hook reads what is there
    if training.init_scale is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=training.init_scale)
    environ = {"RUNHEALTH_RUN": training.run_name if run != RENAMED else run}
    rh = RunHealth(
        config=config,
        environ=environ,
        hostname=lambda: "node-a",
        model=model,
        optimizer=optimizer,
        scaler=scaler,
    )
    with rh:
        opened = train(rh, training, optimizer)
    assert rh.run == run
    where = harness.where(run, rh.incarnation, Path(config.spool.directory))
    places = where.places()
    event(f"stored {len(where.stored)}, dead-lettered {len(where.dead)}, spooled {len(where.spooled)}")
    expected = range(1, opened + 1)
    missing = [attempt for attempt in expected if places[attempt] == 0]
    twice = sorted(attempt for attempt, count in places.items() if count > 1)
    assert not missing and not twice, (
        f"windows lost {missing}, in two places {twice}: {where}; counters {rh.counters}; "
        f"service log: {harness.serve.log_tail()[-1500:]}"
    )
    assert set(places) == set(expected), (
        f"windows the hook never opened: {sorted(set(places) - set(expected))}"
    )
    assert all(reason.strip() for reason in where.reasons), where.reasons
    assert rh.counters["dropped"] == 0, rh.counters
    # The service was up all along: nothing waits in the spool unless it answered a 5xx.
    assert not where.spooled, (
        f"left in the spool with the service up: {where}; {harness.serve.log_tail()[-1500:]}"
    )
    return where


@settings(SETTINGS, max_examples=EXAMPLES)
@given(training=trainings(EVERY))
def test_every_window_is_stored_spooled_or_dead_lettered_with_a_reason(
    harness: Harness, training: Training
) -> None:
    run_training(harness, training)


@settings(SETTINGS, max_examples=PLAUSIBLE_EXAMPLES)
@given(training=trainings(PLAUSIBLE))
def test_every_window_of_plausible_values_is_stored(harness: Harness, training: Training) -> None:
    where = run_training(harness, training)
    assert not where.dead, f"refused: {where.reasons}"


# Regressions: what the first property found, each lost with nothing on disk before its fix.


def one_window_config(tmp_path: Path, **sender: Any) -> RunHealthConfig:
    return RunHealthConfig(
        transport=TransportConfig(run="regression"),
        spool=SpoolConfig(directory=str(tmp_path / "spool"), fsync=False),
        sender=SenderConfig(**{"flush_interval_s": 0.05, "heartbeat_interval_s": 60.0, **sender}),
        readers=ReadersConfig(nvml=False, links=False),
    )


def dead_letters(tmp_path: Path) -> list[dict[str, Any]]:
    found = sorted((tmp_path / "spool").rglob(f"*{DEAD_SUFFIX}"))
    return [entry for path in found for entry in read_lines(path, 0)]


def test_a_window_whose_end_fails_is_dead_lettered_with_the_error(tmp_path: Path) -> None:
    """A loss left unreduced (one per token) cannot be read as the window's loss: the window
    used to vanish in ``window_end`` with only ``hook_errors`` to say so."""
    transport = RecordingTransport()
    with RunHealth(config=one_window_config(tmp_path), transport=transport, environ={}) as rh:
        rh.window_start(sample_ids=[1])
        rh.loss(torch.tensor([2.0, 3.0]), tokens=2)
        rh.window_end()
        rh.window_start(sample_ids=[2])
        rh.loss(2.5, tokens=2)
        rh.window_end()
    [entry] = dead_letters(tmp_path)
    assert "window_end failed" in entry["reason"] and "2 elements" in entry["reason"]
    assert [(r["kind"], r["attempt"], r["incarnation"]) for r in entry["records"]] == [
        ("step", 1, rh.incarnation)
    ]
    assert [s["attempt"] for s in transport.records("step")] == [2]
    assert rh.counters["hook_errors"] == 1 and rh.counters["dead_lettered"] == 1


def test_a_window_that_cannot_be_rendered_is_dead_lettered_with_the_error(tmp_path: Path) -> None:
    """An infinite token count fails the record's render on the sender thread: it was counted
    as dropped and written nowhere."""
    transport = RecordingTransport()
    with RunHealth(config=one_window_config(tmp_path), transport=transport, environ={}) as rh:
        for tokens in (4, math.inf, 4):
            rh.window_start()
            rh.loss(1.0, tokens=tokens)
            rh.window_end()
    [entry] = dead_letters(tmp_path)
    assert entry["reason"].startswith("not rendered: OverflowError")
    assert [(r["attempt"], r["step"]) for r in entry["records"]] == [(2, 2)]
    assert [s["attempt"] for s in transport.records("step")] == [1, 3]
    assert rh.counters["dropped"] == 0 and rh.counters["dead_lettered"] == 1


def test_a_record_json_cannot_carry_is_dead_lettered_and_the_rest_of_its_batch_stored(
    harness: Harness, tmp_path: Path
) -> None:
    """An integer past 64 bits (here a data wait) failed the whole batch's encoding in the
    sender's cycle: every window of the batch was lost, with ``hook_errors`` 1."""
    run = "unencodable"
    transport = TransportConfig(url=harness.serve.url, token=harness.token(run), run=run)
    config = dataclasses.replace(
        one_window_config(tmp_path, batch_records=10, flush_interval_s=5.0), transport=transport
    )
    with RunHealth(config=config, environ={}) as rh:
        for wait in (0.5, 2**70, 0.5):
            rh.window_start(data_wait_s=wait)
            rh.loss(1.0, tokens=4)
            rh.window_end()
    assert [r["attempt"] for r in step_rows(harness.serve.db, run) if r["incarnation"] == rh.incarnation] == [
        1,
        3,
    ]
    [entry] = dead_letters(tmp_path)
    assert "not encodable as JSON" in entry["reason"] and "'data_wait_s'" in entry["reason"]
    assert [r["attempt"] for r in entry["records"]] == [2]


def test_the_transport_names_each_record_json_cannot_carry() -> None:
    transport = HttpTransport(TransportConfig(url="http://127.0.0.1:9", token="t", run="r"))
    good = {"kind": "step", "attempt": 1}
    delivery = transport.post([good, {**good, "tokens": 2**64}, {**good, "sample_ids": ["a\udc80b"]}])
    assert (delivery.outcome, delivery.bad_indexes) == (Outcome.REJECTED, (1, 2))
    assert "record 1: field 'tokens'" in delivery.reason and "record 2: field 'sample_ids'" in delivery.reason


class Raising(RecordingTransport):
    def post(self, records: Sequence[Record]) -> Delivery:
        raise ValueError("a transport's own bug")


def test_a_transport_that_raises_leaves_its_batch_dead_lettered(tmp_path: Path) -> None:
    counters = Counters()
    spool = Spool(SpoolConfig(directory=str(tmp_path)), "r", "node.rank0.x", counters)
    sender = Sender(SenderConfig(close_timeout_s=0.5), Raising(), spool, counters)
    sender.start()
    sender.submit({"kind": "step", "attempt": 1})
    sender.close()
    [entry] = list(read_lines(spool.dead_letter_path, 0))
    assert entry["reason"] == "not sent: ValueError: a transport's own bug"
    assert entry["records"] == [{"kind": "step", "attempt": 1}]
    assert counters.snapshot()["dead_lettered"] == 1


def test_a_dead_letter_json_cannot_carry_is_still_written(tmp_path: Path) -> None:
    """What cannot be sent is what the dead-letter file is for: written by the standard
    library when the fast encoder refuses it."""
    spool = Spool(SpoolConfig(directory=str(tmp_path)), "r", "node.rank0.x", Counters())
    spool.dead_letter([{"kind": "step", "tokens": 2**70, "sample_ids": ["a\udc80"]}], "a \udc80 reason", None)
    spool.append([{"kind": "step", "tokens": 2**70}])
    [entry] = list(read_lines(spool.dead_letter_path, 0))
    assert entry["records"] == [{"kind": "step", "tokens": 2**70, "sample_ids": ["a\udc80"]}]
    assert entry["reason"] == "a \udc80 reason"
    batch = spool.head()
    assert batch is not None and batch.records == [{"kind": "step", "tokens": 2**70}]


def test_a_scale_that_cannot_be_read_leaves_the_window_recorded_without_it(tmp_path: Path) -> None:
    """A window's start failed after counting its attempt (here the scaler's scale is past a
    float), and the window was never opened: its loss went nowhere."""
    transport = RecordingTransport()
    scaler = torch.amp.GradScaler("cpu", init_scale=10**400)
    with RunHealth(config=one_window_config(tmp_path), transport=transport, environ={}, scaler=scaler) as rh:
        rh.window_start(sample_ids=[7])
        rh.loss(1.5, tokens=4)
        rh.window_end()
    [step] = transport.records("step")
    assert (step["attempt"], step["reported_loss"], step["sample_ids"]) == (1, 1.5, [7])
    assert "loss_scale" not in step and rh.counters["hook_errors"] == 1


def test_a_sample_ids_function_that_raises_leaves_the_window_recorded_without_ids(tmp_path: Path) -> None:
    """``rh.windows``: the trainer's ``sample_ids`` raising kept the window from opening."""
    transport = RecordingTransport()

    def ids(batch: dict[str, Any]) -> list[int]:
        return [batch["id"]]  # the second batch has none

    with RunHealth(config=one_window_config(tmp_path), transport=transport, environ={}) as rh:
        for _ in rh.windows([{"id": 1}, {}, {"id": 3}], sample_ids=ids):
            rh.loss(1.0, tokens=4)
    steps = transport.records("step")
    assert [(s["attempt"], s.get("sample_ids")) for s in steps] == [(1, [1]), (2, None), (3, [3])]
    assert rh.counters["hook_errors"] == 1
