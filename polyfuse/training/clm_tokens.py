"""run_clm.py's preprocessing, as optimum-habana's run_clm.py does it: every text tokenized (the "text" column, else
the first), the tokens of each map batch of 1000 rows concatenated and cut into ``block_size`` blocks (the remainder
dropped), labels = input_ids."""

from __future__ import annotations

import logging
from itertools import chain


logger = logging.getLogger("polyfuse")


def block_size_for(block_size, tokenizer, config) -> int:
    """--block_size, or the tokenizer's ``model_max_length`` capped at min(1024, max_position_embeddings)."""
    max_pos = getattr(config, "max_position_embeddings", None) or 1024
    limit = tokenizer.model_max_length
    if block_size is None:
        return min(1024, max_pos) if limit > max_pos else limit
    if block_size > limit:
        logger.warning("polyfuse: --block_size %d is over the tokenizer's model_max_length %d: using %d",
                       block_size, limit, limit)  # fmt: skip
    return min(block_size, limit)


def group_texts(examples: dict, block_size: int) -> dict:
    """One map batch concatenated and cut into blocks of ``block_size`` (the remainder dropped)."""
    joined = {k: list(chain(*examples[k])) for k in examples}
    total = (len(joined[next(iter(examples))]) // block_size) * block_size
    out = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in joined.items()}
    out["labels"] = [list(b) for b in out["input_ids"]]
    return out


def clm_blocks(raw, tokenizer, block_size: int, data, training_args, train: bool):
    """The tokenized, grouped splits of ``raw`` (a DatasetDict or an IterableDatasetDict)."""
    some = raw["train"] if train and "train" in raw else raw["validation"]
    columns = list(some.features) if some.features is not None else ["text"]
    text = "text" if "text" in columns else columns[0]

    def tokenize(examples):
        return tokenizer(examples[text])

    streaming = data.streaming
    mapped = {} if streaming else {"num_proc": data.preprocessing_num_workers,
                                   "load_from_cache_file": not data.overwrite_cache}  # fmt: skip
    with training_args.main_process_first(desc="dataset map tokenization"):
        tokens = raw.map(tokenize, batched=True, remove_columns=columns, **mapped)
    with training_args.main_process_first(desc="grouping texts together"):
        return tokens.map(group_texts, batched=True, fn_kwargs={"block_size": block_size}, **mapped)
