"""Conversion throughput: the single-machine converter vs the raw tokenizer, and the Ray path.

A jsonl corpus of text-like documents (about ``--mib`` MiB) and a byte-level BPE tokenizer
trained on a sample of it (both generated locally, cached under ``$ASYNCFLAT_BENCH_DIR``):

* ``raw``: ``tokenizers``' ``encode_batch`` on the same documents, already in memory, in
  ``--workers`` processes (batches of 512 documents, one rayon thread each): the ceiling
  (and in 1 process: ``raw_n_vs_1`` is how far this machine lets N processes scale now);
  the single-machine converter (reading, tokenizing and writing, same process count, its
  pool's start included); alternated, best of ``--rounds`` each; target: converter >= 0.8x raw.
* Ray: ``convert_distributed`` on a local Ray cluster of 2 CPUs (units of ``--unit-mib``),
  with at most 1 and at most 2 tasks at a time, alternated, best of ``--rounds`` each (from
  the plan to the commit, workers already started); target: 2 workers >= 1.6x one.
  Ray's own start-up (``ray.init``), the first task's round trip (worker processes start
  lazily) and ``ray.shutdown`` are reported apart.

Prints one JSON line (tokens/s).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_dir, emit

ROOT = Path(__file__).resolve().parents[1]

WORDS = (
    "the of and to in is was for on that with as by at from his her an which were are this be "
    "or has had not their it but all also its one two new first after more time other into over "
    "city river music school history government language system century population football "
    "günther déjà vu naïve café 東京 москва العربية 🙂"
).split()


def ensure_corpus(mib: int) -> tuple[Path, Path]:
    """(a jsonl corpus of about ``mib`` MiB, a BPE tokenizer.json trained on its start)."""
    root = bench_dir() / f"convert-{mib}"
    corpus, tok = root / "corpus.jsonl", root / "tokenizer.json"
    if corpus.exists() and tok.exists():
        return corpus, tok
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    weights = [1 / (i + 1) for i in range(len(WORDS))]
    sample: list[str] = []
    with open(corpus, "w", encoding="utf-8") as f:
        while f.tell() < mib << 20:
            words = rng.choices(WORDS, weights, k=rng.randint(20, 600))
            text = " ".join(w + rng.choice(["", "", "", "s", "ed", ",", "."]) for w in words)
            if len(sample) < 2000:
                sample.append(text)
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["[PAD]"])
    bpe.train_from_iterator(sample, trainer)
    bpe.save(str(tok))
    return corpus, tok


# -- the raw tokenizer, in worker processes ----------------------------------------------------

_tok = None


def _init(path: str) -> None:
    global _tok
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _tok = Tokenizer.from_file(path)


def _encode(texts: list[str]) -> int:
    assert _tok is not None
    return sum(len(e.ids) for e in _tok.encode_batch(texts, add_special_tokens=False))


def raw_tokens_per_s(corpus: Path, tok: Path, workers: int) -> tuple[float, int]:
    with open(corpus, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    batches = [docs[i : i + 512] for i in range(0, len(docs), 512)]
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init, initargs=(str(tok),)) as pool:
        pool.map(_encode, batches[: 2 * workers])  # warm: tokenizer loaded, pool started
        t0 = time.perf_counter()
        tokens = sum(pool.map(_encode, batches, chunksize=1))
        seconds = time.perf_counter() - t0
    return tokens / seconds, tokens


def converter_tokens_per_s(corpus: Path, tok: Path, workers: int) -> tuple[float, int]:
    from asyncflat.writer.convert import ConvertOptions, convert_files

    out = bench_dir() / "convert-out.zarr"
    shutil.rmtree(out, ignore_errors=True)
    options = ConvertOptions(tokenizer=str(tok), workers=workers)
    report = convert_files([corpus], out, options=options)
    shutil.rmtree(out, ignore_errors=True)
    return report.tokens_per_s, sum(report.tokens.values())


def converter_fixed_s(workers: int) -> float:
    """The converter's fixed cost (starting its pool, each worker importing asyncflat): the
    time to convert one short document."""
    from asyncflat.writer.convert import ConvertOptions, convert_texts

    out = bench_dir() / "convert-tiny.zarr"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    convert_texts(["a short document"], out, options=ConvertOptions(workers=workers))
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def ray_figures(corpus: Path, tok: Path, unit_mib: int, rounds: int) -> dict[str, float]:
    """On one local cluster of 2 CPUs: conversions capped at 1 and at 2 tasks at a time,
    alternated (the machine is noisy), best of ``rounds`` each."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # 127.0.0.1 only
    import ray

    from asyncflat.writer.convert import ConvertOptions
    from asyncflat.writer.distributed import RayRunner, convert_distributed

    t0 = time.perf_counter()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}},
    )
    init_s = time.perf_counter() - t0

    @ray.remote(num_cpus=1)
    def ping() -> int:
        return os.getpid()

    t0 = time.perf_counter()
    ray.get([ping.remote() for _ in range(2)])
    first_task_s = time.perf_counter() - t0
    out = bench_dir() / "convert-ray.zarr"
    best = {1: 0.0, 2: 0.0}
    units = 0
    for _ in range(rounds):
        for workers in (1, 2):
            shutil.rmtree(out, ignore_errors=True)
            runner = RayRunner(max_tasks=workers)
            t0 = time.perf_counter()
            report = convert_distributed(
                [corpus],
                out,
                options=ConvertOptions(tokenizer=str(tok)),
                runner=runner,
                unit_bytes=unit_mib << 20,
            )
            rate = sum(report.tokens.values()) / (time.perf_counter() - t0)
            best[workers] = max(best[workers], rate)
            units = report.units
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    ray.shutdown()
    return {
        "one": best[1],
        "two": best[2],
        "units": units,
        "init_s": init_s,
        "first_task_s": first_task_s,
        "shutdown_s": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="corpus size (MiB of jsonl)")
    parser.add_argument("--workers", type=int, default=2, help="processes (raw and converter)")
    parser.add_argument("--unit-mib", type=int, default=2, help="Ray: input MiB per task")
    parser.add_argument("--rounds", type=int, default=3, help="alternated runs per setting")
    parser.add_argument("--skip-ray", action="store_true")
    args = parser.parse_args()
    corpus, tok = ensure_corpus(args.mib)
    raw = raw_one = conv = 0.0
    for _ in range(args.rounds):  # alternated, best of each: the machine is noisy
        rate, raw_tokens = raw_tokens_per_s(corpus, tok, args.workers)
        raw = max(raw, rate)
        raw_one = max(raw_one, raw_tokens_per_s(corpus, tok, 1)[0])
        rate, conv_tokens = converter_tokens_per_s(corpus, tok, args.workers)
        conv = max(conv, rate)
        assert raw_tokens == conv_tokens, (raw_tokens, conv_tokens)
    figures: dict[str, object] = {
        "benchmark": "convert",
        "corpus_mib": args.mib,
        "tokens": conv_tokens,
        "workers": args.workers,
        "rounds": args.rounds,
        "load_average_1min": os.getloadavg()[0],
        "raw_tokenizer_tokens_per_s": round(raw),
        # what this machine gives N processes over one, right now (a busy machine: < N)
        "raw_tokenizer_1_process_tokens_per_s": round(raw_one),
        "raw_n_vs_1": round(raw / raw_one, 3),
        "converter_tokens_per_s": round(conv),
        "converter_vs_raw": round(conv / raw, 3),
        "converter_fixed_s": round(converter_fixed_s(args.workers), 2),
    }
    if not args.skip_ray:
        # In a process of its own: Ray keeps per-process state.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            ray_run = pool.apply(ray_figures, (corpus, tok, args.unit_mib, args.rounds))
        figures.update(
            {
                "ray_units": ray_run["units"],
                "ray_1_worker_tokens_per_s": round(ray_run["one"]),
                "ray_2_workers_tokens_per_s": round(ray_run["two"]),
                "ray_2_vs_1": round(ray_run["two"] / ray_run["one"], 3),
                # ray_2_vs_1 against the raw tokenizer's own 2-vs-1 (meaningful for --workers 2)
                "ray_scaling_vs_raw_scaling": round(
                    ray_run["two"] / ray_run["one"] / (raw / raw_one), 3
                ),
                "ray_init_s": round(ray_run["init_s"], 2),
                "ray_first_task_s": round(ray_run["first_task_s"], 2),
                "ray_shutdown_s": round(ray_run["shutdown_s"], 2),
            }
        )
    emit(figures)


if __name__ == "__main__":
    main()
