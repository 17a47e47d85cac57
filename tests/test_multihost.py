"""Multi-host with real processes: two ``jax.distributed`` processes on 127.0.0.1, 4 CPU devices each.

One module fixture writes a dataset, then starts, at the same time,

* a pair of processes (``jax.distributed.initialize``, 4 devices each, one global mesh of 8), and
* one plain process with 8 devices (the elasticity baseline),

each running every case of ``CASES`` with tests/multihost_worker.py and writing its results to a
temp dir. The tests then check, against the oracle (tests/reference_impl.py) computed here:

* every gathered global batch, and every process's own shards, equal the oracle bit for bit
  (steps across minipoch boundaries, a resume mid-minipoch, out-of-order loads);
* each process filled only the streams its rows belong to, and read its share of the bytes;
* 1 process and 2 processes give the same global batches (elasticity);
* no asyncflat thread outlives ``close()``.

Every wait is bounded: ``initialization_timeout`` in the workers and one deadline for all of
them here; on failure or timeout every child is killed and its log is shown.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference_impl import ReferenceLoader, load_split_arrays

import asyncflat

pytestmark = pytest.mark.multihost

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
INIT_TIMEOUT_S = 30
#: After "done" (its results saved), a worker has this long to exit; past it, it dumps every
#: thread's stack to its log and exits with status 1 (see :func:`_run_workers`).
EXIT_GRACE_S = 20
RUN_TIMEOUT_S = 150  # all three workers together; a healthy run takes ~15-25 s on 2 cores

SEQ_LEN, BATCH, SPB, RBPSB = 16, 16, 8, 3  # a read block = 8 rows = 128 tokens = one chunk

# start: a resume step (mid-minipoch where the minipoch spans several steps); count: steps
# iterated from there, crossing at least one minipoch boundary.
CASES: list[dict[str, Any]] = [
    # streams=1: bips 16 > seqs_per_buffer 24 / 2: most steps straddle two minipochs
    dict(name="s1", streams=1, sharding="default", packing=True, start=1, count=5),
    dict(name="s2", streams=2, sharding="default", packing=True, start=4, count=7),
    dict(name="s8", streams=8, sharding="default", packing=True, start=6, count=20),
    dict(name="s8_interleaved", streams=8, sharding="interleaved", packing=True, start=5, count=9),
    dict(
        name="s2_batch_seq_unpacked",
        streams=2,
        sharding="batch_seq",
        packing=False,
        start=2,
        count=4,
    ),
    dict(
        name="s4_replicated",
        streams=4,
        sharding="replicated_over_processes",
        packing=True,
        start=3,
        count=4,
    ),
]
for _i, _case in enumerate(CASES):
    _case.update(len=SEQ_LEN, batch=BATCH, spb=SPB, rbpsb=RBPSB, seed=11 + _i)

# A mixture of three sources over the same store (different seeds, so different orders), 8
# streams: each process holds 4 streams of every source.
MIXTURES: list[dict[str, Any]] = [
    dict(
        name="mixture_s8",
        streams=8,
        seeds=[21, 22, 23],
        weights=[0.5, 0.3, 0.2],
        mix_seed=3,
        block_rows=5,
        steps=9,
        start=2,
        out_of_order=[8, 0, 4],
        len=SEQ_LEN,
        batch=BATCH,
        spb=SPB,
        rbpsb=RBPSB,
    )
]


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: the coordinator binds it seconds after
    this returns, and meanwhile no connection made on this machine (another test process's
    included) is given a port from outside that range."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"  # gRPC must not use a proxy
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count before importing jax
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run_workers(jobs: list[tuple[Path, int, Path]], timeout_s: float) -> list[str]:
    """Run ``worker SPEC PID`` for each job at once; fail (killing all) on error or timeout.

    A worker that saved its results and printed "done" but whose interpreter did not exit
    within ``EXIT_GRACE_S`` (it dumps its threads' stacks and exits 1 by itself; one still
    running is killed) is not a failure of the results, which these tests check: it is returned
    (the log's tail, stacks included) and written to the terminal, so a hung exit stays
    visible without failing the module's correctness checks. The library's own exit is tested
    in tests/test_lifecycle.py and tests/test_loop.py."""
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def logs() -> str:
        return "\n".join(
            f"--- {log.name} ---\n{log.read_text(errors='replace')[-12000:]}" for _, log in procs
        )

    def done(log: Path) -> bool:
        return "] done\n" in log.read_text(errors="replace")

    hung: list[str] = []
    try:
        for spec, pid, log in jobs:
            with open(log, "wb") as out:
                procs.append(
                    (
                        subprocess.Popen(
                            [sys.executable, str(WORKER), str(spec), str(pid)],
                            cwd=str(REPO),
                            env=_child_env(),
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                        ),
                        log,
                    )
                )
        deadline = time.monotonic() + timeout_s
        exit_deadline: float | None = None
        while True:
            codes = [p.poll() for p, _ in procs]
            failed = [c not in (None, 0) and not done(log) for c, (_, log) in zip(codes, procs)]
            if any(failed):
                pytest.fail(f"a multihost worker failed (exit codes {codes}):\n{logs()}")
            if all(c is not None or done(log) for c, (_, log) in zip(codes, procs)):
                # every worker finished its work; give the stragglers their exit grace
                if exit_deadline is None:
                    exit_deadline = time.monotonic() + EXIT_GRACE_S + 10
                if all(c is not None for c in codes) or time.monotonic() > exit_deadline:
                    break
            elif time.monotonic() > deadline:
                pytest.fail(f"multihost workers still running after {timeout_s} s:\n{logs()}")
            time.sleep(0.05)
        for (_, log), code in zip(procs, codes):
            if code != 0:
                tail = log.read_text(errors="replace")[-12000:]
                hung.append(f"--- {log.name}: exit status {code} after done ---\n{tail}")
        if hung:
            sys.__stderr__.write(
                "\nmultihost: a worker's interpreter exit hung after its results were saved:\n"
                + "\n".join(hung)
                + "\n"
            )
        return hung
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
        for p, _ in procs:
            p.wait(10)


class Run:
    """The results of one run (1 or 2 processes): per process, stats and saved arrays."""

    def __init__(self, out: Path, processes: int) -> None:
        self.stats = [json.loads((out / f"stats-{p}.json").read_text()) for p in range(processes)]
        self.arrays = []
        for p in range(processes):
            with np.load(out / f"result-{p}.npz") as data:
                self.arrays.append({k: data[k] for k in data.files})

    def served(self, process: int, case: str) -> list[dict[str, np.ndarray]]:
        arrays = self.arrays[process]
        count = self.stats[process]["cases"][case]["served"]
        fields = (
            "step",
            "targets",
            "is_seq_start",
            "local_targets",
            "local_is_seq_start",
            "covered",
        )
        return [{f: arrays[f"{case}/{i}/{f}"] for f in fields} for i in range(count)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("multihost")
    dataset = root / "data.zarr"
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 1000, rng.integers(1, 41)) for _ in range(2000)]
    asyncflat.write_flat_tokens(
        dataset, {"train": seqs, "validation": seqs[:50]}, chunk_tokens=SPB * SEQ_LEN
    )
    for case in CASES:  # out-of-order steps: the last, the first, one before the resume step
        step_count = _oracle(str(dataset), case["name"]).step_count
        case["out_of_order"] = [step_count - 1, 0, max(0, case["start"] - 1)]
        assert case["start"] + case["count"] <= step_count

    jobs = []
    outs = {}
    for name, processes, devices in [("two", 2, 4), ("one", 1, 8)]:
        out = root / name
        out.mkdir()
        spec = dict(
            dataset=str(dataset),
            num_processes=processes,
            local_devices=devices,
            port=_free_port(),
            init_timeout_s=INIT_TIMEOUT_S,
            dump_stacks_after_s=RUN_TIMEOUT_S - 15,
            exit_grace_s=EXIT_GRACE_S,
            out=str(out),
            cases=CASES,
            mixtures=MIXTURES,
        )
        spec_path = root / f"spec-{name}.json"
        spec_path.write_text(json.dumps(spec))
        jobs += [(spec_path, pid, root / f"{name}-{pid}.log") for pid in range(processes)]
        outs[name] = (out, processes)
    t0 = time.monotonic()
    exit_hangs = _run_workers(jobs, RUN_TIMEOUT_S)
    wall = time.monotonic() - t0
    result = {name: Run(out, processes) for name, (out, processes) in outs.items()}
    result["wall_s"] = wall
    result["dataset"] = str(dataset)
    result["exit_hangs"] = exit_hangs
    return result


@functools.cache
def _oracle(dataset: str, case_name: str) -> ReferenceLoader:
    case = next(c for c in CASES if c["name"] == case_name)
    tokens, starts = load_split_arrays(dataset, "train")
    return ReferenceLoader(
        tokens,
        starts,
        seq_len=case["len"],
        batch=case["batch"],
        streams=case["streams"],
        read_blocks_per_shuffle_buffer=case["rbpsb"],
        sequences_per_read_block=case["spb"],
        seed=case["seed"],
        sequence_packing=case["packing"],
    )


def _expected_steps(case: dict[str, Any]) -> list[int]:
    return list(range(case["start"], case["start"] + case["count"])) + case["out_of_order"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_two_processes_match_the_oracle(runs: dict[str, Any], case: dict[str, Any]) -> None:
    oracle = _oracle(runs["dataset"], case["name"])
    run: Run = runs["two"]
    for process in range(2):
        served = run.served(process, case["name"])
        assert [int(s["step"]) for s in served] == _expected_steps(case)
        for s in served:
            step = int(s["step"])
            targets, is_start = oracle.batch(step)
            # The global batch, gathered from both processes.
            np.testing.assert_array_equal(s["targets"], targets, err_msg=f"step {step}")
            np.testing.assert_array_equal(s["is_seq_start"], is_start, err_msg=f"step {step}")
            # This process's own shards, at their places in the global batch.
            covered = s["covered"]
            assert covered.any()
            np.testing.assert_array_equal(s["local_targets"][covered], targets[covered])
            np.testing.assert_array_equal(s["local_is_seq_start"][covered], is_start[covered])
    # Together the two processes' shards cover the whole batch.
    first = [run.served(p, case["name"])[0]["covered"] for p in range(2)]
    assert (first[0] | first[1]).all()


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_each_process_fills_only_its_streams(runs: dict[str, Any], case: dict[str, Any]) -> None:
    single = runs["one"].stats[0]["cases"][case["name"]]
    assert single["streams"] == list(range(case["streams"]))
    bips = case["batch"] // case["streams"]
    hosts = []
    for process in range(2):
        stats = runs["two"].stats[process]["cases"][case["name"]]
        rows = np.flatnonzero(runs["two"].served(process, case["name"])[0]["covered"].any(axis=1))
        expected_streams = sorted(set((rows // bips).tolist()))
        assert stats["streams"] == expected_streams, (process, stats["streams"])
        assert set(stats["fill_streams"]) <= set(expected_streams)
        assert stats["host_batch_rows"] == len(rows)
        share = len(expected_streams) / case["streams"]
        if len(rows) == len(expected_streams) * bips:
            # The host holds every row of its streams: it needs the same minipochs of them as a
            # single host does, and every stream's buffers hold the same number of blocks, so it
            # reads exactly k/S of what one host serving all S streams reads.
            assert stats["bytes_useful"] == single["bytes_useful"] * share
        else:
            # Hosts share a stream: each reads only the minipochs its own rows need (with
            # streams=1 a host may skip a minipoch that only the other host's rows touch).
            assert 0 < stats["bytes_useful"] <= single["bytes_useful"] * share
        hosts.append(stats)
    if case["streams"] >= 2 and case["sharding"] != "replicated_over_processes":
        # Disjoint streams: the hosts split the work between them.
        assert not set(hosts[0]["streams"]) & set(hosts[1]["streams"])
        assert hosts[0]["bytes_useful"] + hosts[1]["bytes_useful"] == single["bytes_useful"]
        if case["packing"]:  # chunks = blocks: the hosts read disjoint chunks (after opening)
            # Not exactly half: a load that arrives before its blocks reads its rows on its own
            # first (a few small reads whose number depends on timing).
            for host in hosts:
                assert host["bytes_read"] <= 0.6 * single["bytes_read"]
    if case["streams"] == 8:
        assert [len(h["streams"]) for h in hosts] == [4, 4]
        assert hosts[0]["bytes_useful"] == hosts[1]["bytes_useful"] == single["bytes_useful"] / 2


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_one_and_two_processes_give_the_same_batches(
    runs: dict[str, Any], case: dict[str, Any]
) -> None:
    one = runs["one"].served(0, case["name"])
    for process in range(2):
        two = runs["two"].served(process, case["name"])
        assert len(one) == len(two)
        for a, b in zip(one, two):
            assert int(a["step"]) == int(b["step"])
            np.testing.assert_array_equal(a["targets"], b["targets"])
            np.testing.assert_array_equal(a["is_seq_start"], b["is_seq_start"])
    assert runs["one"].served(0, case["name"])[0]["covered"].all()


def _mixture_oracle(dataset: str, case: dict[str, Any], step: int) -> tuple[np.ndarray, ...]:
    """The global batch of a mixture step from the sources' oracles and the pure assignment."""
    from asyncflat.plan.mixture import Assignment

    weights = tuple(case["weights"])
    r = case["batch"] // case["streams"]
    assignment = Assignment([(0, weights)], r, case["block_rows"], case["mix_seed"])
    tokens, starts = load_split_arrays(dataset, "train")
    oracles = [
        ReferenceLoader(
            tokens,
            starts,
            seq_len=case["len"],
            batch=case["batch"],
            streams=case["streams"],
            read_blocks_per_shuffle_buffer=case["rbpsb"],
            sequences_per_read_block=case["spb"],
            seed=seed,
            sequence_packing=True,
        )
        for seed in case["seeds"]
    ]
    targets = np.zeros((case["batch"], case["len"]), np.uint32)
    is_start = np.zeros((case["batch"], case["len"]), bool)
    for stream in range(case["streams"]):
        for j, (s, k) in enumerate(zip(*assignment.step_slots(stream, step))):
            source_targets, source_starts = oracles[s].batch(int(k) // r)
            targets[stream * r + j] = source_targets[stream * r + int(k) % r]
            is_start[stream * r + j] = source_starts[stream * r + int(k) % r]
    return targets, is_start


@pytest.mark.parametrize("case", MIXTURES, ids=[c["name"] for c in MIXTURES])
def test_a_mixture_on_two_processes_is_its_sources_oracles(
    runs: dict[str, Any], case: dict[str, Any]
) -> None:
    expected_steps = list(range(case["start"], case["steps"])) + case["out_of_order"]
    r = case["batch"] // case["streams"]
    for name, processes in (("two", 2), ("one", 1)):
        for process in range(processes):
            served = runs[name].served(process, case["name"])
            assert [int(s["step"]) for s in served] == expected_steps
            for s in served:
                targets, is_start = _mixture_oracle(runs["dataset"], case, int(s["step"]))
                np.testing.assert_array_equal(s["targets"], targets)
                np.testing.assert_array_equal(s["is_seq_start"], is_start)
                covered = s["covered"]
                np.testing.assert_array_equal(s["local_targets"][covered], targets[covered])
            # Every source fills only the streams of this process's rows.
            record = runs[name].stats[process]["cases"][case["name"]]
            rows = np.flatnonzero(served[0]["covered"].any(axis=1))
            streams = sorted(set((rows // r).tolist()))
            assert len(streams) == case["streams"] // processes
            for source_streams, fill_streams in zip(
                record["source_streams"], record["fill_streams"]
            ):
                assert source_streams == streams
                assert set(fill_streams) <= set(streams) and fill_streams
            assert record["threads_after_close"] == []


def test_no_thread_outlives_close_and_run_is_quick(runs: dict[str, Any]) -> None:
    for name in ("one", "two"):
        for stats in runs[name].stats:
            for case, record in stats["cases"].items():
                assert record["threads_after_close"] == [], (name, case)
    assert [s["process_index"] for s in runs["two"].stats] == [0, 1]
    assert runs["wall_s"] < RUN_TIMEOUT_S
