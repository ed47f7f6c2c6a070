"""run_lora_clm.py's preprocessing, as optimum-habana's run_lora_clm.py does it: a one-column data set (``text``)
becomes (input "", output text); otherwise each example becomes an Alpaca-style prompt (instruction / input /
output), a text-to-SQL prompt (``--sql_prompt``: question / context / answer) or a chat-template prompt
(``--chat_prompt``); prompt + answer is tokenized to ``--max_seq_length`` (padded to it unless
``--dataset_concatenation``, an EOS appended where it fits), the prompt's tokens masked out of the labels with
``--train_on_inputs False``; ``--dataset_concatenation`` joins every column and cuts ``--max_seq_length`` blocks."""

from __future__ import annotations


IGNORE_INDEX = -100
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
PROMPT_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)
SQL_PROMPT = (
    "You are a text-to-SQL model. Your job is to answer questions about a database. "
    "You are given a question and a context regarding one or more tables in the database.\n\n"
    "You must output the SQL query that answers the question. The SQL query must be between [SQL] and [/SQL] tags.\n\n"
    "### Question: \n{question}\n\n### Context: \n{context}\n\n### Response:"
)
CHAT_QUERY = "Answer the below Query based on the Content given below. #### Query: {instruction} #### Content: {input}"


def _prompt(example: dict, data, tokenizer) -> tuple:
    if data.chat_prompt:
        chat = [{"role": "user", "content": CHAT_QUERY.format_map(example)}]
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), example["output"]
    if data.sql_prompt:
        return SQL_PROMPT.format_map(example), example["answer"]
    template = PROMPT_WITH_INPUT if example.get("input", "") != "" else PROMPT_WITHOUT_INPUT
    return template.format_map(example), example["output"]


def _missing(split, data) -> list:
    need = ("question", "context", "answer") if data.sql_prompt else ("instruction", "input", "output")
    if not data.sql_prompt and not data.chat_prompt:
        need = ("instruction", "output")  # input is optional in the Alpaca prompt
    return [c for c in need if c not in split.column_names]


def to_prompts(raw, data, tokenizer, train: bool, evaluate: bool):
    """(splits of (prompt_sources, prompt_targets) or of (input, output), one column data set?)."""
    used = [s for s, on in (("train", train), ("validation", evaluate)) if on and s in raw]
    if any(raw[s].num_columns == 1 for s in used):
        text = raw[used[0]].column_names[0]  # "text" in the data sets this is for (openassistant-guanaco)
        raw = raw.map(lambda x: {"input": "", "output": x[text]})
        return raw.remove_columns([c for c in raw[used[0]].column_names if c not in ("input", "output")]), True
    renames = {"instruction_column_name": "question" if data.sql_prompt else "instruction",
               "input_column_name": "context" if data.sql_prompt else "input",
               "output_column_name": "answer" if data.sql_prompt else "output"}  # fmt: skip
    for key in list(raw):
        split = raw[key]
        for arg, to in renames.items():
            if getattr(data, arg):
                if getattr(data, arg) not in split.column_names:
                    raise ValueError(f"--{arg} {getattr(data, arg)!r}: no such column in split {key!r} "
                                     f"({', '.join(split.column_names)})")  # fmt: skip
                split = split.rename_column(getattr(data, arg), to)
        missing = _missing(split, data)
        if missing:
            raise ValueError(f"split {key!r} has no column {', '.join(map(repr, missing))} (it has "
                             f"{', '.join(split.column_names)}): name them with --instruction_column_name / "
                             "--input_column_name / --output_column_name")  # fmt: skip
        pairs = [_prompt(ex, data, tokenizer) for ex in split]
        split = split.add_column("prompt_sources", [p[0] for p in pairs])
        split = split.add_column("prompt_targets", [p[1] for p in pairs])
        raw[key] = split.remove_columns(
            [c for c in split.column_names if c not in ("prompt_sources", "prompt_targets")]
        )
    return raw, False


def _tokenize(tokenizer, texts, data, add_eos: bool, add_bos: bool) -> dict:
    saved = {k: getattr(tokenizer, k) for k in ("add_eos_token", "add_bos_token") if hasattr(tokenizer, k)}
    padding = False if data.dataset_concatenation else "max_length"
    if not data.dataset_concatenation and "add_eos_token" in saved:
        tokenizer.add_eos_token = add_eos
    if "add_bos_token" in saved:
        tokenizer.add_bos_token = add_bos
    try:
        out = tokenizer(texts, truncation=True, max_length=data.max_seq_length, padding=padding, return_tensors=None)
    finally:
        for k, v in saved.items():
            setattr(tokenizer, k, v)
    for ids, mask in zip(out["input_ids"], out["attention_mask"]):
        if add_eos and ids[-1] != tokenizer.eos_token_id and len(ids) < data.max_seq_length:
            ids.append(tokenizer.eos_token_id)
            mask.append(1)
    out["labels"] = [list(ids) for ids in out["input_ids"]]
    out["input_id_len"] = [len(ids) for ids in out["input_ids"]]
    return out


def preprocess(examples, tokenizer, data, train_on_inputs: bool) -> dict:
    keys = list(examples.data.keys())
    if len(keys) != 2:
        raise ValueError(f"Unsupported dataset format, number of keys {keys} != 2")
    add_bos = not data.chat_prompt
    both = _tokenize(tokenizer, [s + t for s, t in zip(examples[keys[0]], examples[keys[1]])], data, True, add_bos)
    if not train_on_inputs:
        sources = _tokenize(tokenizer, examples[keys[0]], data, False, add_bos)
        for label, n in zip(both["labels"], sources["input_id_len"]):
            label[:n] = [IGNORE_INDEX] * n
    return {"input_ids": both["input_ids"], "labels": both["labels"], "attention_mask": both["attention_mask"]}


def concatenate(split, max_seq_length: int):
    """Every column joined and cut into blocks of ``max_seq_length`` (the remainder dropped)."""
    import datasets

    out = {}
    for column in split.features:
        joined = [t for row in split[column] for t in row]
        out[column] = [joined[i * max_seq_length : (i + 1) * max_seq_length]
                       for i in range(len(joined) // max_seq_length)]  # fmt: skip
    return datasets.Dataset.from_dict(out)


def lora_examples(
    raw, tokenizer, data, finetune, training_args, train: bool, evaluate: bool
) -> dict:  # size: the three argument groups and the splits asked for
    """{"train": ..., "validation": ...} tokenized as run_lora_clm.py tokenizes them."""
    raw, single = to_prompts(raw, data, tokenizer, train, evaluate)
    with training_args.main_process_first(desc="dataset map pre-processing"):
        tokens = raw.map(preprocess, batched=True, load_from_cache_file=not data.overwrite_cache,
                         fn_kwargs={"tokenizer": tokenizer, "data": data,
                                    "train_on_inputs": finetune.train_on_inputs})  # fmt: skip
    out = {}
    for split, on in (("train", train), ("validation", evaluate)):
        if not on or split not in tokens:
            continue
        ds = tokens[split]
        if data.dataset_concatenation:
            ds = concatenate(ds.remove_columns(["input", "output"] if single else ["prompt_sources", "prompt_targets"]),
                             data.max_seq_length)  # fmt: skip
        out[split] = ds
    return out
