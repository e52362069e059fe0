"""Benchmark training start-up to the first iteration: the demo's ~2.5 MB dataset vs a ~2 GB one.

    python -m tools.bench_data_startup                        # build both in a temporary dir, time, delete
    python -m tools.bench_data_startup --output-dir /tmp/startup --keep     # keep the data for another run
    python -m tools.bench_data_startup --target-bytes 500e6 --repeats 1 --nproc 2

Start-up must not grow with the corpus beyond reading the ``.idx`` (and megatron-core's cached
index files). What runs:

1. `small`: the demo's data: tools/make_stdlib_corpus.py (4 MB of the Python stdlib's sources),
   tools/train_tokenizer.py (4096 pieces), tools/preprocess_data.py (``.bin/.idx`` + sidecar).
2. `large`: the small dataset's documents repeated until the ``.bin`` holds ``--target-bytes``,
   written with megatron-core's ``IndexedDatasetBuilder`` (the small ``.bin`` appended once per
   repeat), with its sidecar (same largest token id, scaled counts): real text, repeated.
3. Per round, for small then large, with a cold then a warm index cache (cold: megatron-core's
   index cache directory, ``--data-cache-path``, removed first; warm: the one the cold run left):
   - `to_first_iteration_s`: the real entry point, ``pretrain_gpt_moe.py`` (a tiny GPT-MoE,
     ``--train-iters 1``, ``--nproc`` processes), timed from launch to its first logged iteration;
   - `datasets_s`: ``build_gpt_datasets`` alone in this process (the start-up work that reads
     the data: validation, sidecar, megatron-core's index build or load).
   Figures are medians (and minima, ``_min``: the least disturbed round on a shared machine)
   over ``--repeats`` rounds; small and large alternate so background load hits both alike.
   The OS page cache is left alone (dropping it needs root and hits everyone).

Prints one JSON object per (dataset, cache) and a summary with the large/small ratios; the
target is a warm-cache `to_first_iteration_s` ratio within 1.5.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from tools.cli import HelpFormatter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MARKER = ".bench_data_startup"
FIRST_ITERATION = re.compile(r"iteration\s+1/")
MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --num-experts 4 --micro-batch-size 2 "
    "--moe-aux-loss-coeff 0.01 --train-iters 1 --lr 1e-3 --eval-iters 0 --eval-interval 0 --log-interval 1 "
    "--split 98,2,0"
).split()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument(
        "--output-dir",
        default=None,
        help="where the datasets go (default: a new directory under the system temp dir); "
        "reused when a previous --keep run of this tool left its data there",
    )
    p.add_argument("--keep", action="store_true", help="keep --output-dir afterwards (default: delete it)")
    p.add_argument("--target-bytes", type=float, default=2e9, help="size of the large .bin (default 2e9)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (medians are reported)")
    p.add_argument("--nproc", type=int, default=1, help="training processes (torchrun when > 1)")
    p.add_argument("--timeout", type=int, default=600, help="seconds one training launch may take")
    args = p.parse_args(argv)
    if args.target_bytes < 1e6:
        p.error(f"--target-bytes {args.target_bytes:g} is smaller than the demo data; use e.g. 2e9")
    if args.repeats < 1 or args.nproc < 1:
        p.error(f"--repeats {args.repeats} and --nproc {args.nproc} must be >= 1")
    return args


# ----------------------------------------------------------------------------- the datasets


def work_dir(args) -> str:
    """The output directory: new, or one this tool made before (never someone else's files)."""
    if args.output_dir is None:
        return tempfile.mkdtemp(prefix="bench_data_startup_")
    path = os.path.abspath(args.output_dir)
    if os.path.isdir(path) and os.listdir(path) and not os.path.exists(os.path.join(path, MARKER)):
        raise SystemExit(
            f"--output-dir {path} is not empty and was not made by this tool; give a new or empty directory"
        )
    os.makedirs(path, exist_ok=True)
    return path


def make_small(directory: str) -> tuple[str, str]:
    """The demo's data in `directory`; returns (prefix, tokenizer model). Skipped when present."""
    from tools import make_stdlib_corpus, preprocess_data, train_tokenizer

    prefix, model = os.path.join(directory, "small_text_document"), os.path.join(directory, "tokenizer.model")
    if all(os.path.exists(p) for p in (prefix + ".bin", prefix + ".idx", prefix + ".meta.json", model)):
        return prefix, model
    corpus = os.path.join(directory, "stdlib.jsonl")
    make_stdlib_corpus.main(["--output", corpus])
    train_tokenizer.main(
        [
            "--input",
            corpus,
            "--model-prefix",
            os.path.join(directory, "tokenizer"),
            "--vocab-size",
            "4096",
            "--num-threads",
            "2",
        ]
    )
    preprocess_data.main(
        [
            "--input",
            corpus,
            "--tokenizer-model",
            model,
            "--output-prefix",
            os.path.join(directory, "small"),
            "--workers",
            "2",
            "--append-eod",
        ]
    )
    return prefix, model


def make_large(small: str, directory: str, target_bytes: float) -> str:
    """`small`'s documents repeated to `target_bytes` of tokens, with its sidecar; returns the prefix."""
    import dataclasses

    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    from megatron_moe.data.metadata import metadata_path, read_metadata, write_metadata

    prefix = os.path.join(directory, "large_text_document")
    small_meta = read_metadata(small)
    copies = max(2, round(target_bytes / small_meta.bin_bytes))
    meta = dataclasses.replace(
        small_meta,
        num_tokens=copies * small_meta.num_tokens,
        num_sequences=copies * small_meta.num_sequences,
        num_documents=copies * small_meta.num_documents,
        bin_bytes=copies * small_meta.bin_bytes,
        written_by="tools/bench_data_startup.py (tools/preprocess_data.py's sidecar of the copies)",
    )
    if read_metadata(prefix) == meta:
        return prefix
    free = shutil.disk_usage(directory).free
    if free < meta.bin_bytes * 1.1 + 1e9:
        raise SystemExit(
            f"--target-bytes {target_bytes:g}: {directory} has {free / 1e9:.1f} GB free; "
            f"pick a smaller target or another --output-dir"
        )
    started = time.perf_counter()
    source = IndexedDataset(small)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.dtype(small_meta.dtype).type)
    with open(small + ".bin", "rb") as stream:
        tokens = stream.read()
    for _ in range(copies):  # add_index would do the same, but re-read the index and collect garbage each time
        builder.data_file.write(tokens)
    num_sequences = len(source.sequence_lengths)
    builder.sequence_lengths = numpy.tile(source.sequence_lengths, copies).tolist()
    starts = numpy.arange(copies, dtype=numpy.int64)[:, None] * num_sequences
    builder.document_indices = [0, *(starts + source.document_indices[None, 1:]).ravel().tolist()]
    builder.finalize(prefix + ".idx")
    write_metadata(metadata_path(prefix), meta)
    print(
        f"wrote {meta.bin_bytes / 1e9:.2f} GB ({copies} copies of {small}) in {time.perf_counter() - started:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return prefix


def describe(prefix: str) -> dict:
    from megatron_moe.data.metadata import read_metadata

    meta = read_metadata(prefix)
    return {
        "bin_bytes": meta.bin_bytes,
        "idx_bytes": os.path.getsize(prefix + ".idx"),
        "num_tokens": meta.num_tokens,
        "num_documents": meta.num_documents,
    }


# ----------------------------------------------------------------------------- the timings


def time_to_first_iteration(prefix: str, model: str, cache: str, args) -> float:
    """Seconds from launching pretrain_gpt_moe.py to its first logged iteration."""
    script = os.path.join(ROOT, "pretrain_gpt_moe.py")
    launcher = [sys.executable]
    if args.nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", f"--master-port={free_port()}"]
    flags = [
        *MODEL, "--global-batch-size", str(2 * args.nproc), "--data-path", prefix, "--tokenizer-model", model,
        "--data-cache-path", cache,
    ]  # fmt: skip
    python_path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path)
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*launcher, script, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    first, lines = None, []
    try:
        for line in proc.stdout:
            lines.append(line)
            if first is None and FIRST_ITERATION.search(line):
                first = time.perf_counter() - started
        proc.wait(timeout=args.timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"pretrain_gpt_moe.py on {prefix} failed ({proc.returncode}):\n{''.join(lines[-40:])}")
    return first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_datasets(prefix: str, tokenizer, cache: str, nproc: int) -> float:
    """Seconds of build_gpt_datasets in this process, as the run above calls it."""
    from megatron_moe.data.datasets import build_gpt_datasets

    started = time.perf_counter()
    build_gpt_datasets(
        data_path=[prefix],
        split="98,2,0",
        tokenizer=tokenizer,
        seq_length=256,
        seed=1234,
        train_samples=2 * nproc,
        valid_samples=0,
        test_samples=0,
        cache_dir=cache,
        is_built_on_rank=lambda: True,
    )
    return time.perf_counter() - started


def measure(datasets: dict, model: str, directory: str, args) -> dict:
    """{(name, cache state): {figure: [seconds per round]}}, small and large alternating."""
    import logging

    from megatron_moe.data.tokenizer import SentencePieceTokenizer

    logging.getLogger("megatron").setLevel(logging.WARNING)
    tokenizer = SentencePieceTokenizer(model)
    times = {}
    for round_ in range(args.repeats):
        for name, prefix in datasets.items():
            cache = os.path.join(directory, f"cache_{name}")
            for state in ("cold", "warm"):
                if state == "cold":
                    shutil.rmtree(cache, ignore_errors=True)
                figures = times.setdefault((name, state), {"to_first_iteration_s": [], "datasets_s": []})
                figures["to_first_iteration_s"].append(time_to_first_iteration(prefix, model, cache, args))
                if state == "cold":
                    shutil.rmtree(cache, ignore_errors=True)
                figures["datasets_s"].append(time_datasets(prefix, tokenizer, cache, args.nproc))
            print(f"round {round_ + 1}/{args.repeats}: {name} done", file=sys.stderr, flush=True)
    return times


def report(times: dict, datasets: dict, args) -> None:
    medians = {key: {k: round(statistics.median(v), 3) for k, v in figures.items()} for key, figures in times.items()}
    fastest = {key: {k: round(min(v), 3) for k, v in figures.items()} for key, figures in times.items()}
    for (name, state), figures in medians.items():
        rounds = {f"{k}_all": [round(x, 3) for x in v] for k, v in times[(name, state)].items()}
        lowest = {f"{k}_min": v for k, v in fastest[(name, state)].items()}
        row = {
            "dataset": name,
            "cache": state,
            "nproc": args.nproc,
            "repeats": args.repeats,
            **describe(datasets[name]),
            **figures,
            **lowest,
            **rounds,
        }
        print(json.dumps(row), flush=True)
    summary = {"summary": True, "target_ratio_warm": 1.5}
    for state in ("warm", "cold"):
        for figure in ("to_first_iteration_s", "datasets_s"):
            ratio = medians[("large", state)][figure] / medians[("small", state)][figure]
            summary[f"ratio_{figure[:-2]}_{state}"] = round(ratio, 3)
            ratio = fastest[("large", state)][figure] / fastest[("small", state)][figure]
            summary[f"ratio_{figure[:-2]}_{state}_min"] = round(ratio, 3)
    sizes = {name: describe(prefix)["bin_bytes"] for name, prefix in datasets.items()}
    summary["size_ratio"] = round(sizes["large"] / sizes["small"], 1)
    summary["within_target"] = summary["ratio_to_first_iteration_warm"] <= 1.5
    print(json.dumps(summary), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    directory = work_dir(args)
    open(os.path.join(directory, MARKER), "w").close()
    try:
        small, model = make_small(directory)
        datasets = {"small": small, "large": make_large(small, directory, args.target_bytes)}
        report(measure(datasets, model, directory, args), datasets, args)
    finally:
        if args.keep:
            print(f"kept {directory}", file=sys.stderr)
        else:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
