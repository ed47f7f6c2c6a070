"""Text data for examples/run_clm.py and examples/run_lora_clm.py through the ``datasets`` library, offline: a data set
by name (a local folder of data files, a ``save_to_disk`` folder, or a Hub data set already in the datasets cache) or
local files (.txt, .json / .jsonl, .csv), with the validation split cut from the training split as optimum-habana's
scripts cut it (``train[:N%]`` / ``train[N%:]``; streaming: every 100 rows). Every problem is one ValueError line."""

from __future__ import annotations

import os
from typing import Optional


EXTENSIONS = {"txt": "text", "text": "text", "json": "json", "jsonl": "json", "csv": "csv"}


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ValueError("--dataset_name / --train_file need the datasets library: pip install datasets") from None
    return datasets


def _is_saved(path: str) -> bool:
    """A folder written by Dataset(Dict).save_to_disk."""
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")
    )


def _load(name: str, config: Optional[str], **kw):
    """load_dataset, its offline failure turned into one line naming how to get the data set."""
    datasets = _datasets()
    try:
        return datasets.load_dataset(name, config, **kw)
    except (ConnectionError, FileNotFoundError) as e:
        if os.path.exists(name):
            raise ValueError(f"--dataset_name {name}: {str(e).splitlines()[0]}") from None
        cfg = f", {config!r}" if config else ""
        raise ValueError(
            f"--dataset_name {name}: not a local folder, and not in the datasets cache (nothing is downloaded): "
            f'fetch it once where there is network (python -c "import datasets; datasets.load_dataset({name!r}{cfg})"'
            ") or give a local folder"
        ) from None


def _split_in_memory(ds, percent: int):
    """(validation, train) = ds[:percent%], ds[percent%:], rounded as datasets' split strings round."""
    k = int(round(len(ds) * percent / 100))
    return ds.select(range(k)), ds.select(range(k, len(ds)))


def _stream_split(stream, percent: int):
    """optimum-habana's split_streaming_dataset: row i goes to validation when i % 100 < percent, to training when
    i % 100 > percent (row ``percent`` of each hundred goes to neither, as there)."""
    datasets = _datasets()
    if not 0 < percent < 100:
        raise ValueError(f"--validation_split_percentage must be between 0 and 100 when streaming, got {percent}")

    def rows(train: bool):
        for i, example in enumerate(stream):
            if (i % 100 > percent) if train else (i % 100 < percent):
                yield example

    features = stream.features
    return datasets.IterableDatasetDict({
        "train": datasets.IterableDataset.from_generator(rows, gen_kwargs={"train": True}, features=features),
        "validation": datasets.IterableDataset.from_generator(rows, gen_kwargs={"train": False}, features=features),
    })  # fmt: skip


def _source(data, default_file: Optional[str]):
    """(load_dataset path, config name, extra keywords) for the data asked for."""
    if data.dataset_name is not None:
        return data.dataset_name, data.dataset_config_name, {}
    files = {}
    train_file = data.train_file or (None if data.validation_file else default_file)
    if train_file is not None:
        files["train"] = train_file
    if data.validation_file is not None:
        files["validation"] = data.validation_file
    if not files:
        raise ValueError("Need either a --dataset_name or a --train_file / --validation_file")
    kinds = set()
    for split, path in files.items():
        if not os.path.isfile(path):
            raise ValueError(f"--{split if split == 'validation' else 'train'}_file {path!r} does not exist")
        kind = EXTENSIONS.get(path.rsplit(".", 1)[-1].lower())
        if kind is None:
            raise ValueError(f"{path}: a data file should be .txt, .json, .jsonl or .csv")
        kinds.add(kind)
    if len(kinds) > 1:
        raise ValueError("--train_file and --validation_file must be of the same kind (text, json or csv)")
    kind = kinds.pop()
    return kind, None, {"data_files": files, **({"keep_linebreaks": data.keep_linebreaks} if kind == "text" else {})}


def load_raw(data, cache_dir: Optional[str], split_validation: bool, streaming: bool = False,
             default_file: Optional[str] = None, keep_in_memory: bool = False):  # fmt: skip  # size: the scripts' data settings
    """The raw splits (DatasetDict, or IterableDatasetDict when streaming) with a "validation" split cut from
    "train" by --validation_split_percentage where there is none and ``split_validation``."""
    datasets = _datasets()
    name, config, kw = _source(data, default_file)
    percent = data.validation_split_percentage or 0
    if data.dataset_name is not None and _is_saved(name):
        raw = datasets.load_from_disk(name, keep_in_memory=keep_in_memory)
        if isinstance(raw, datasets.Dataset):
            raw = datasets.DatasetDict({"train": raw})
        if split_validation and "validation" not in raw and "train" in raw:
            if not percent:
                raise ValueError("--validation_split_percentage: the data set has no validation split; set one")
            raw["validation"], raw["train"] = _split_in_memory(raw["train"], percent)
        return raw
    kw.update(cache_dir=cache_dir, streaming=streaming)
    if keep_in_memory and not streaming:
        kw["keep_in_memory"] = True
    raw = _load(name, config, **kw)
    if split_validation and "validation" not in raw:
        if not percent:
            raise ValueError("--validation_split_percentage: the data set has no validation split; set one")
        if streaming:
            return _stream_split(_load(name, config, split="train", **kw), percent)
        raw["validation"] = _load(name, config, split=f"train[:{percent}%]", **kw)
        raw["train"] = _load(name, config, split=f"train[{percent}%:]", **kw)
    return raw


def first(ds, n: Optional[int], streaming: bool = False):
    """The first ``n`` examples (all when None)."""
    if n is None:
        return ds
    if streaming:
        return ds.take(n)
    return ds.select(range(min(n, len(ds))))


def train_and_eval(splits: dict, run, empty: str, streaming: bool = False) -> tuple:
    """(train or None, validation or None) from ``splits``, as --do_train / --do_eval and --max_*_samples ask;
    a split asked for but missing or empty is one ValueError (``empty`` says why an empty split is)."""
    data, targs = run.data, run.targs
    out = []
    for split, on, limit in (("train", run.training, data.max_train_samples),
                             ("validation", targs.do_eval, data.max_eval_samples)):  # fmt: skip
        if not on:
            out.append(None)
            continue
        if split not in splits:
            raise ValueError(f"--do_{'train' if split == 'train' else 'eval'} requires a {split} split")
        ds = first(splits[split], limit, streaming)
        if len(ds) == 0 if not streaming else next(iter(ds), None) is None:
            raise ValueError(f"the {split} split {empty}")
        out.append(ds)
    return tuple(out)
