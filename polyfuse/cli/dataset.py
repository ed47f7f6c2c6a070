"""--dataset_name: prompts from a ``datasets`` data set, run as optimum-habana's run_generation.py runs them.

The data set is a local folder of data files (what ``datasets.load_dataset(folder)`` reads), one data file (.json,
.jsonl, .csv, .tsv, .parquet, .txt, .arrow), a folder written by ``save_to_disk``, or a Hugging Face Hub id (read
from the local cache when offline). As optimum-habana: the split is ``test``, else ``validation``, else ``train``
(else the first there is); the rows are shuffled (here with --seed, so a run can be repeated) and the first
--dataset_max_samples kept when > 0; the prompts are the --column_name column, or the first column of strings. Each
prompt is tokenized alone, padded and truncated to --max_input_tokens tokens when > 0, to 16 when it is 0 (the
default), whole when < 0 (its first tokens kept, as optimum-habana's tokenizer truncates), then the rows run in
batches of --batch_size (the last one holds the rest).

The first --warmup batches run untimed first (optimum-habana: the first 3, its --warmup's default; on Gaudi with
--bucket_size and prompts of varied lengths, every prompt bucket: ``warmup_batches``), then every batch once, each
printed as a "Batch n°" block; --run_partial_dataset stops after --n_iterations batches. The Stats give
"Throughput (including tokenization)" (new tokens over the batches' own time, tokenization included here, as the
name says), "Total runtime for dataset" (the timed pass, printing included) and the graph compilation (warm-up) time.
"""

from __future__ import annotations

import os
import sys
import time

from polyfuse.cli.batch_run import generate_batch, input_device
from polyfuse.cli.errors import UsageError


# What a data file's extension means to datasets.load_dataset.
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".txt": "text",
            ".arrow": "arrow"}  # fmt: skip
SPLITS = ("test", "validation", "train")
# optimum-habana's dataset names for MLCommons' pickled OpenOrca (its --mlcommons_dataset), not datasets' data sets.
MLCOMMONS = ("openorca", "mlcommons")
DEFAULT_PROMPT_TOKENS = 16  # --max_input_tokens 0 (its default) with a data set
SEPARATOR = "-" * 50


def check_dataset_args(args) -> None:
    """What cannot go with --dataset_name (before anything loads); the flags it makes meaningless warn."""
    name = args.dataset_name
    if name in MLCOMMONS:
        raise UsageError(f"--dataset_name {name}: MLCommons' pickled data set (--mlcommons_dataset) is not supported; "
                         "give a data set of the Hub or a local one")  # fmt: skip
    given = [f for f in ("--prompt", "--prompt_file", "--chat_file") if getattr(args, f[2:], None)]
    if given:
        raise UsageError(f"--dataset_name and {given[0]}: give one of them")
    if args.simulate_dyn_prompt is not None:
        raise UsageError("--dataset_name and --simulate_dyn_prompt: give one of them (as optimum-habana asserts)")
    if args.use_chat_template or args.system_prompt is not None:
        print("warning: --use_chat_template / --system_prompt change nothing with --dataset_name: the column is "
              "tokenized as it is (as optimum-habana does)", file=sys.stderr)  # fmt: skip
        args.use_chat_template, args.system_prompt = False, None


def _load(datasets, name: str, seed: int):
    """(rows, split) of ``name`` (see the module's docstring), shuffled with ``seed``."""
    where = f"--dataset_name {name}"
    try:
        if os.path.isdir(name) and any(os.path.isfile(os.path.join(name, f))
                                       for f in ("state.json", "dataset_dict.json")):  # fmt: skip
            data = datasets.load_from_disk(name)
        elif os.path.isfile(name):
            builder = BUILDERS.get(os.path.splitext(name)[1].lower())
            if builder is None:
                raise UsageError(f"{where}: not a data file datasets reads ({', '.join(BUILDERS)})")
            data = datasets.load_dataset(builder, data_files=name)
        else:
            data = datasets.load_dataset(name)
    except UsageError:
        raise
    except FileNotFoundError as e:
        raise UsageError(f"{where}: no such local data set, nor a Hub data set in the local cache ({e})") from None
    except Exception as e:  # offline and not cached, bad files, ...: one line
        raise UsageError(f"{where}: cannot load it ({type(e).__name__}: {e})") from None
    if isinstance(data, datasets.Dataset):
        return data.shuffle(seed=seed), None
    split = next((s for s in SPLITS if s in data), next(iter(data), None))
    if split is None:
        raise UsageError(f"{where}: the data set has no split")
    return data[split].shuffle(seed=seed), split


def _column(rows, given, where: str) -> str:
    if given is not None:
        if given not in rows.column_names:
            raise UsageError(f"--column_name {given}: no such column in {where} ({', '.join(rows.column_names)})")
        return given
    strings = [k for k, v in rows.features.items() if getattr(v, "dtype", None) == "string"]
    if not strings:
        raise UsageError(f"{where}: no column of strings to take prompts from; give --column_name")
    print(f"No column name was given so automatically choosing '{strings[0]}' for prompts. If you would like to use "
          "another column of the dataset, you can set the argument `--column_name`.", file=sys.stderr)  # fmt: skip
    return strings[0]


def read_dataset(args) -> dict:
    """The prompts of --dataset_name, read and checked before the model loads: ``{"prompts", "split", "column"}``."""
    check_dataset_args(args)
    try:
        import datasets
    except ImportError:
        raise UsageError("--dataset_name needs the datasets package: pip install datasets") from None
    datasets.disable_progress_bars()
    where = f"--dataset_name {args.dataset_name}"
    rows, split = _load(datasets, args.dataset_name, args.seed)
    if args.dataset_max_samples > 0:
        rows = rows.select(range(min(args.dataset_max_samples, rows.num_rows)))
    column = _column(rows, args.column_name, where)
    prompts = rows[column]
    bad = next((i for i, p in enumerate(prompts) if not isinstance(p, str)), None)
    if bad is not None:
        raise UsageError(
            f"--column_name {column}: row {bad + 1} of {where} is {type(prompts[bad]).__name__}, not text"
        )
    if not prompts:
        raise UsageError(f"{where}: no rows")
    return {"prompts": list(prompts), "split": split, "column": column}


def encode_rows(args, tokenizer, texts: list, device):
    """One batch tokenized as optimum-habana tokenizes the column (see the module's docstring), left-padded."""
    length = args.max_input_tokens if args.max_input_tokens > 0 else (DEFAULT_PROMPT_TOKENS if
                                                                      args.max_input_tokens == 0 else -1)  # fmt: skip
    side, tokenizer.truncation_side = tokenizer.truncation_side, "right"
    try:
        if length > 0:
            enc = tokenizer(texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        else:
            enc = tokenizer(texts, padding=True, return_tensors="pt")
    finally:
        tokenizer.truncation_side = side
    empty = [i for i, n in enumerate(enc.attention_mask.sum(-1).tolist()) if n == 0]
    if empty:
        raise UsageError(f"--dataset_name: prompt {texts[empty[0]]!r} has no tokens: nothing to generate from")
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def warmup_batches(args, tokenizer, batches: list, static: bool) -> list:
    """The indices of the batches the warm-up runs: the first --warmup (optimum-habana's); on a static-shape device
    with --bucket_size > 0 and prompts of varied lengths (--max_input_tokens < 0), --warmup passes over one batch of
    every prompt bucket, the longest first (the KV cache is allocated at its largest once; cli/dyn_prompt.py)."""
    first = list(range(min(args.warmup, len(batches))))
    if not (static and args.bucket_size > 0 and args.max_input_tokens < 0):
        return first
    buckets = {}
    for i, texts in enumerate(batches):
        width = max(len(ids) for ids in tokenizer(texts).input_ids)
        buckets.setdefault(-(-width // args.bucket_size), i)
    order = [buckets[b] for b in sorted(buckets, reverse=True)]
    return [i for _ in range(args.warmup) for i in order]


def run_dataset(args, model, tokenizer, data: dict, device, bars: bool = False) -> dict:
    """Warm-up batches, then the timed pass over the data set (printed per batch); the numbers and texts. On a
    static-shape device (Gaudi) a last, smaller batch is filled up with copies of its last prompt (one batch shape:
    no graph of its own), whose outputs are dropped."""
    prompts, bs, runtime = data["prompts"], args.batch_size, model.runtime
    batches = [prompts[s : s + bs] for s in range(0, len(prompts), bs)]
    static = getattr(runtime, "static_shapes", False)
    gen = runtime.sampling_generator(args.seed)

    def one(texts):
        rows = list(texts) + [texts[-1]] * (bs - len(texts) if static else 0)
        ids, mask = encode_rows(args, tokenizer, rows, input_device(args, device))
        out, timings, _ = generate_batch(args, model, tokenizer, ids, mask, gen, bars)
        keep = len(texts) * (out.shape[0] // len(rows))  # --num_return_sequences: rows r * n + j
        return ids[: len(texts)].cpu(), out[:keep].cpu(), timings

    t0 = time.perf_counter()
    plan = warmup_batches(args, tokenizer, batches, static)
    for n, i in enumerate(plan):
        print(f"Warming up batch {n + 1}/{len(plan)}", flush=True)
        one(batches[i])
    runtime.synchronize()
    compile_s = time.perf_counter() - t0
    runtime.reset_peak_memory()
    inputs, outputs, seconds, tokens, start = [], [], 0.0, 0, time.perf_counter()
    for i, texts in enumerate(batches):
        t = time.perf_counter()
        ids, out, timings = one(texts)
        seconds += time.perf_counter() - t
        tokens += timings["new_tokens"] * out.shape[0]
        shown = out[:, ids.shape[1] :] if args.print_new_text_only else out
        inputs += tokenizer.batch_decode(ids, skip_special_tokens=True)
        outputs += tokenizer.batch_decode(shown, skip_special_tokens=True)
        print(f"{SEPARATOR}\nBatch n°{i + 1}\nInput: {inputs[-len(texts):]}\nOutput: {outputs[-out.shape[0]:]}\n"
              f"{SEPARATOR}", flush=True)  # fmt: skip
        if args.run_partial_dataset and args.n_iterations == i + 1:
            break
    total = time.perf_counter() - start
    return {
        "throughput": tokens / seconds if seconds > 0 else None,
        "total_runtime_for_dataset": total,
        "graph_compilation_duration": compile_s,
        "memory": runtime.memory_stats(),
        "dataset": {
            "name": args.dataset_name,
            "split": data["split"],
            "column": data["column"],
            "rows": len(prompts),
            "batches_timed": min(i + 1, len(batches)),
        },  # fmt: skip
        "input": inputs,
        "output": outputs,
    }


def print_dataset_report(r: dict) -> None:
    """optimum-habana's Stats block of a data-set run."""
    stats = f"Throughput (including tokenization) = {r['throughput']} tokens/second"
    sep = "-" * len(stats)
    lines = [stats, f"Total runtime for dataset: {r['total_runtime_for_dataset']}"]
    for k, v in r["memory"].items():
        if v is not None:
            lines.append("{:35} = {} GB".format(k[:-5].replace("_", " ").capitalize(), v))
    lines.append(f"Graph compilation duration          = {r['graph_compilation_duration']} seconds")
    print("\nStats:\n" + sep + "\n" + "\n".join(lines) + "\n" + sep)
