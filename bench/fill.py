"""Fill throughput: the engine filling a shuffle buffer vs tensorstore reading the same blocks.

Two layouts of the reference benchmark dataset (warm page cache):
* ``seqax``: 4M-token chunks, 1M-token blocks (a block read decodes a 4x bigger chunk);
  target: engine >= 1.0x tensorstore on the same blocks.
* ``aligned``: chunks = blocks; target: engine >= 0.5x blosc's own 2-thread decode rate
  of the same chunks.
The engine's figure is the best whole fill into buffers already touched (as in steady state),
from ``stats()["fills"]``; prefetch is off so fills do not overlap.

``checksum``: what the crc32c of every chunk (the writer's default in format 3) costs a fill:
the same tokens written with and without it (``FlatTokensWriter(checksum=...)``), fills
alternating between the two stores (A B, then B A, ...) so machine noise hits both alike, in
rounds over every minipoch; the best and the median whole fill of each, each round's ratio of
median fills (their median is the figure, their spread says how noisy it is), and the process's
CPU seconds per useful GB of each; target: a cost of at most 5%. Beside it the direct, low-noise
figure: the hash's own time over the same chunk objects against their decode's, one thread.
``--checksum-only`` measures just that (no tensorstore, no 2^28-token stores).

Prints one JSON line (GB/s of useful tokens, 1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BLOCK_TOKENS, REFERENCE_TOKENS, bench_dir, emit, ensure_dataset

LEN, BATCH, SPB, RBPSB = 2048, 64, 512, 64
#: Read blocks of 1M tokens per buffer in the checksum comparison: many fills from a small store.
CHECKSUM_RBPSB = 8
#: The largest cost of checksums the project accepts (issue 37).
CHECKSUM_TARGET = 0.05


def warm_page_cache(path: str) -> None:
    for file in Path(path).rglob("*"):
        if file.is_file():
            file.read_bytes()


def engine_fill_gbps(path: str) -> tuple[float, list]:
    """Best rate of a whole fill (prefetch off, so fills do not overlap) into warm buffers."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import asyncflat

    params = asyncflat.FlatTokensParams(path, 1, RBPSB, SPB, seed=0, sequence_packing=True)
    options = asyncflat.EngineOptions(prefetch=False)
    with asyncflat.ShufflingLoader(
        "train", params, asyncflat.TokenBatchParams(LEN, BATCH), options=options
    ) as loader:
        plan = loader.plan
        minipochs = list(range(plan.minipoch_count))
        # Two rounds: the first touches the two buffers' fresh memory (a one-time cost on these
        # VMs), the second measures fills into memory already mapped, as in steady state.
        for m in minipochs * 2:
            loader.load(plan.first_step(m))  # with 2 buffers, round two refills every minipoch
        warm = [f for f in loader.stats()["fills"][2:] if not f["cancelled"]]  # not the first two
        if not warm:
            raise SystemExit("need at least 3 minipochs (use more --tokens)")
        blocks = [plan.buffer_blocks(0, f["minipoch"]) for f in warm]
    return max(f["useful_bytes"] / f["duration_s"] / 1e9 for f in warm), blocks


def tensorstore_gbps(
    path: str, zarr_format: int, block_sets: list[np.ndarray], repeats: int = 3
) -> float:
    import tensorstore as ts

    driver = "zarr" if zarr_format == 2 else "zarr3"
    array = ts.open(
        {"driver": driver, "kvstore": {"driver": "file", "path": path + "/train/encoded_tokens"}},
        read=True,
    ).result()
    block_tokens = SPB * LEN
    best = 0.0
    for _ in range(repeats):
        for blocks in block_sets:
            t0 = time.perf_counter()
            futures = [
                array[int(b) * block_tokens : (int(b) + 1) * block_tokens].read() for b in blocks
            ]
            total = sum(f.result().nbytes for f in futures)
            best = max(best, total / (time.perf_counter() - t0) / 1e9)
    return best


def blosc_decode_gbps(path: str, block_sets: list[np.ndarray]) -> float:
    """numcodecs' Blosc on 2 threads decoding the chunk objects of the same blocks (aligned)."""
    from numcodecs import blosc

    chunk_dir = Path(path) / "train" / "encoded_tokens" / "c"
    raw = [(chunk_dir / str(int(b))).read_bytes() for blocks in block_sets for b in blocks]
    blosc.set_nthreads(2)
    out = np.empty(SPB * LEN, np.uint32)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for data in raw:
            blosc.decompress(data, out)
        best = max(best, len(raw) * out.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def checksum_store(tokens: int, checksum: bool) -> str:
    """A store of ``tokens`` synthetic tokens in 1M-token chunks, with or without crc32c."""
    from _common import synthetic_sequences

    from asyncflat import FlatTokensWriter

    path = bench_dir() / f"checksum-{int(checksum)}-{tokens}.zarr"
    if not path.exists():
        with FlatTokensWriter(path, chunk_tokens=BLOCK_TOKENS, checksum=checksum) as writer:
            for sequences in synthetic_sequences(tokens):
                writer.append("train", sequences)
    return str(path)


def checksum_figures(tokens: int, rounds: int) -> dict:
    """Fill rates with and without checksums, fills alternating between the two stores, and
    the hash's own share of the decode (:func:`hash_share`)."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import asyncflat

    paths = {flag: checksum_store(tokens, flag) for flag in (False, True)}
    for path in paths.values():
        warm_page_cache(path)
    # per round: the fill rates, and the CPU seconds of the whole process per useful GB (what a
    # fill costs when the machine's cores are all busy, and much less sensitive than a rate to
    # other processes sharing them)
    rates: dict[bool, list[list[float]]] = {False: [], True: []}
    cpu: dict[bool, list[list[float]]] = {False: [], True: []}
    loaders = {
        flag: asyncflat.ShufflingLoader(
            "train",
            asyncflat.FlatTokensParams(path, 1, CHECKSUM_RBPSB, SPB, seed=0, sequence_packing=True),
            asyncflat.TokenBatchParams(LEN, BATCH),
            options=asyncflat.EngineOptions(prefetch=False),
        )
        for flag, path in paths.items()
    }
    try:
        plan = loaders[False].plan
        for round_ in range(rounds + 1):  # round 0 touches the buffers' fresh memory: not kept
            for flag in loaders:
                rates[flag].append([])
                cpu[flag].append([])
            for m in range(plan.minipoch_count):
                order = list(loaders.items())
                for flag, loader in order if (m + round_) % 2 else order[::-1]:  # A B, B A, ...
                    cpu0 = time.process_time()
                    loader.load(plan.first_step(m))
                    cpu1 = time.process_time()
                    fill = loader.stats()["fills"][-1]
                    if round_ and fill["duration_s"] and not fill["cancelled"]:
                        rates[flag][-1].append(fill["useful_bytes"] / fill["duration_s"] / 1e9)
                        cpu[flag][-1].append((cpu1 - cpu0) / (fill["useful_bytes"] / 1e9))
    finally:
        for loader in loaders.values():
            loader.close()
    flat = {flag: [r for round_ in rates[flag][1:] for r in round_] for flag in rates}
    flat_cpu = {flag: [c for round_ in cpu[flag][1:] for c in round_] for flag in cpu}
    median = {flag: statistics.median(r) for flag, r in flat.items()}
    # each round's ratio of medians: the spread says how far one round's figure can be trusted
    rate_ratios = [
        statistics.median(with_) / statistics.median(without)
        for with_, without in zip(rates[True][1:], rates[False][1:], strict=True)
    ]
    cpu_costs = [
        statistics.median(with_) / statistics.median(without) - 1
        for with_, without in zip(cpu[True][1:], cpu[False][1:], strict=True)
    ]
    share = hash_share(paths[True], rounds=5)
    share["python_rate_beside_hash"] = python_rate_beside_hash()
    plain_cpu = statistics.median(flat_cpu[False])
    return {
        "tokens": tokens,
        "rounds": rounds,
        "fills_each": len(flat[True]),
        "plain_gbps": round(max(flat[False]), 3),
        "crc32c_gbps": round(max(flat[True]), 3),
        "plain_median_gbps": round(median[False], 3),
        "crc32c_median_gbps": round(median[True], 3),
        "crc32c_over_plain_median": round(median[True] / median[False], 3),
        "crc32c_over_plain_rounds": [round(r, 3) for r in rate_ratios],
        "crc32c_over_plain_round_median": round(statistics.median(rate_ratios), 3),
        "plain_cpu_s_per_gb": round(plain_cpu, 3),
        "crc32c_cpu_s_per_gb": round(statistics.median(flat_cpu[True]), 3),
        "crc32c_cpu_cost": round(statistics.median(flat_cpu[True]) / plain_cpu - 1, 3),
        "crc32c_cpu_cost_rounds": [round(c, 3) for c in cpu_costs],
        **share,
        "hash_share_of_plain_fill_cpu": round(share["hash_s_per_gb"] / plain_cpu, 4),
    }


def hash_share(path: str, rounds: int) -> dict:
    """What the hash alone costs beside the decode of the same chunks, timed on one thread
    (low noise: no scheduling, no other fill work): each chunk object read from the page cache,
    its crc32c computed and its Blosc frame decoded into a buffer, as a fill's read and decode
    jobs do; ``rounds`` passes, the median of each figure. Seconds per useful (decoded) GB."""
    from asyncflat.storage import blosc
    from asyncflat.storage.chunks import crc32c

    objects = sorted(
        f for f in (Path(path) / "train" / "encoded_tokens" / "c").rglob("*") if f.is_file()
    )
    out = np.empty(BLOCK_TOKENS, np.uint32)
    hash_s, decode_s, decoded = [], [], len(objects) * out.nbytes / 1e9
    for _ in range(rounds):
        spent = [0.0, 0.0]
        for file in objects:
            data = np.frombuffer(file.read_bytes(), np.uint8)
            body = data[:-4]  # a view: the trailer off, no copy
            t0 = time.perf_counter()
            if crc32c(body) != int(data[-4:].view("<u4")[0]):
                raise SystemExit(f"{file} fails its crc32c")
            t1 = time.perf_counter()
            blosc.decode_into(body, 0, out, out.nbytes)
            t2 = time.perf_counter()
            spent[0] += t1 - t0
            spent[1] += t2 - t1
        hash_s.append(spent[0] / decoded)
        decode_s.append(spent[1] / decoded)
    hashed = statistics.median(hash_s)
    decode = statistics.median(decode_s)
    return {
        "hash_s_per_gb": round(hashed, 5),
        "decode_s_per_gb": round(decode, 5),
        "hash_share_of_decode": round(hashed / decode, 4),
        "hash_share_of_decode_spread": [
            round(min(h / d for h, d in zip(hash_s, decode_s, strict=True)), 4),
            round(max(h / d for h, d in zip(hash_s, decode_s, strict=True)), 4),
        ],
    }


def python_rate_beside_hash(seconds: float = 0.3, repeats: int = 5) -> float:
    """A Python loop's rate while another thread hashes large buffers, over its rate alone: about
    1 when the hash releases the GIL (ctypes does for a CDLL's functions), about 0.5 or less
    when it holds it. Shows that the readers' hash never stalls the trainer's thread."""
    import threading

    from asyncflat.storage.chunks import crc32c

    def spin() -> float:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            count += 1
        return count / seconds

    data = np.ones(64 << 20, np.uint8)
    ratios = []
    for _ in range(repeats):  # the median of alternating repeats: other processes share cores
        alone = spin()
        stop = threading.Event()

        def hash_until_stopped(stop: threading.Event = stop) -> None:
            while not stop.is_set():
                crc32c(data)

        thread = threading.Thread(target=hash_until_stopped)
        thread.start()
        try:
            beside = spin()
        finally:
            stop.set()
            thread.join()
        ratios.append(beside / alone)
    return round(statistics.median(ratios), 3)


def meets_checksum_target(figures: dict) -> bool:
    """The cost of checksums, by the median of the rounds' ratios of median fills (the best
    fill of a noisy machine swings by more than the target), at most :data:`CHECKSUM_TARGET`."""
    return 1 - figures["crc32c_over_plain_round_median"] <= CHECKSUM_TARGET


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=REFERENCE_TOKENS)
    parser.add_argument("--checksum-tokens", type=int, default=1 << 26)
    parser.add_argument("--checksum-rounds", type=int, default=6)
    parser.add_argument(
        "--checksum-only", action="store_true", help="only the with/without checksum comparison"
    )
    args = parser.parse_args()
    checksum = checksum_figures(args.checksum_tokens, args.checksum_rounds)
    checksum["meets_checksum_target"] = meets_checksum_target(checksum)
    if args.checksum_only:
        emit({"bench": "fill", "checksum": checksum})
        return
    figures: dict = {"bench": "fill", "tokens": args.tokens, "checksum": checksum}
    for layout, zarr_format in (("seqax", 2), ("aligned", 3)):
        path = ensure_dataset(layout, args.tokens)
        warm_page_cache(path)
        engine, block_sets = engine_fill_gbps(path)
        store = tensorstore_gbps(path, zarr_format, block_sets)
        figures[layout] = {
            "engine_gbps": round(engine, 3),
            "tensorstore_gbps": round(store, 3),
            "engine_over_tensorstore": round(engine / store, 2),
        }
        if layout == "aligned":
            blosc_rate = blosc_decode_gbps(path, block_sets)
            figures[layout].update(
                blosc_2thread_gbps=round(blosc_rate, 3),
                engine_over_blosc=round(engine / blosc_rate, 2),
            )
    figures["meets_seqax_target"] = figures["seqax"]["engine_over_tensorstore"] >= 1.0
    figures["meets_aligned_target"] = figures["aligned"]["engine_over_blosc"] >= 0.5
    emit(figures)


if __name__ == "__main__":
    main()
