"""The argument dataclasses of examples/run_clm.py and examples/run_lora_clm.py: optimum-habana 1.21's
``ModelArguments`` / ``DataTrainingArguments`` (run_clm.py) and ``ModelArguments`` / ``DataArguments`` /
``FinetuneArguments`` (run_lora_clm.py) with their names, types and defaults, plus polyfuse's own (``gguf_file``,
``model_impl``, run_clm.py's ``lora_*``). ``attn_softmax_bf16`` and ``use_fused_rope`` are training arguments
(PolyfuseTrainingArguments) under the same spelling.

``SCRIPT_FIELDS`` says what each does (docs/training.md shows it; tests/test_clm_scripts.py checks it against the
fields read from optimum-habana's scripts, tests/data/optimum_habana_1.21_language_modeling_args.json)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_TYPES = ["lora", "ia3", "adalora", "llama-adapter", "vera", "ln_tuning"]


@dataclass
class ModelSource:
    """What both scripts load: the model, its config and tokenizer."""

    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local model folder or .gguf file (default: the built-in SmolLM2-135M GGUF)."}
    )
    config_name: Optional[str] = field(
        default=None, metadata={"help": "Config folder if not the model's (without a model: random weights)."}
    )
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "Tokenizer folder if not the model's."})
    cache_dir: Optional[str] = field(
        default=None, metadata={"help": "Cache folder for data sets and Hub files (nothing is downloaded)."}
    )
    token: Optional[str] = field(default=None, metadata={"help": "Hub token (unused: nothing is downloaded)."})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "A fast (tokenizers) tokenizer."})
    model_revision: str = field(default="main", metadata={"help": "Only main (local files)."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Unused: polyfuse runs its own model code, never a checkpoint's."}
    )
    gguf_file: Optional[str] = field(default=None, metadata={"help": "GGUF file name inside the model folder."})
    model_impl: str = field(
        default="transformers",
        metadata={"help": "'transformers' (patched in place with polyfuse.patch) or 'polyfuse' (polyfuse's Llama)."},
    )


@dataclass
class CacheArguments:
    """optimum-habana's ModelArguments.use_cache; transformers 5's TrainingArguments has its own use_cache (default
    False), which the scripts use there instead (the same flag)."""

    use_cache: bool = field(default=True, metadata={"help": "config.use_cache (False with gradient checkpointing)."})


@dataclass
class ModelArguments(ModelSource):
    """run_clm.py's."""

    model_type: Optional[str] = field(
        default=None, metadata={"help": "Training from scratch: a transformers model type (e.g. llama)."}
    )
    config_overrides: Optional[str] = field(
        default=None,
        metadata={"help": "Random weights with the config changed, e.g. 'hidden_size=64,num_hidden_layers=2'."},
    )
    torch_dtype: Optional[str] = field(
        default=None,
        metadata={"help": "Weights dtype; None / auto: the checkpoint's.",
                  "choices": ["auto", "bfloat16", "float16", "float32"]},
    )  # fmt: skip


@dataclass
class DataSource:
    """Where both scripts read text: a data set (a local folder, a save_to_disk folder, or a cached Hub data set)
    or local files."""

    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Data set: local folder, save_to_disk folder, or a cached Hub name."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "The data set's configuration."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Training file (.txt, .json, .jsonl, .csv)."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Evaluation file (same kinds)."})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Keep the first N training examples."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Keep the first N evaluation examples."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Redo the cached preprocessing."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks of .txt files."})
    save_last_ckpt: bool = field(default=True, metadata={"help": "Save the trained model in --output_dir."})


@dataclass
class DataTrainingArguments(DataSource):
    """run_clm.py's."""

    streaming: bool = field(default=False, metadata={"help": "Stream the data set (needs --max_steps)."})
    block_size: Optional[int] = field(
        default=None, metadata={"help": "Tokens per sequence (default: the tokenizer's limit, at most 1024)."}
    )
    validation_split_percentage: Optional[int] = field(
        default=5, metadata={"help": "Percent of the training split held out where there is no validation split."}
    )
    preprocessing_num_workers: Optional[int] = field(default=None, metadata={"help": "Processes for preprocessing."})


@dataclass
class LoraArguments:
    """run_clm.py's LoRA (polyfuse's addition; run_lora_clm.py has optimum-habana's FinetuneArguments)."""

    lora_rank: int = field(default=0, metadata={"help": "LoRA rank through PEFT (0: no LoRA, full fine-tuning)."})
    lora_alpha: float = field(default=16, metadata={"help": "LoRA alpha (the adapter is scaled by alpha / rank)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA adapters' input."})
    lora_target_modules: List[str] = field(
        default_factory=lambda: ["q_proj", "v_proj"],
        metadata={"help": f"Projections LoRA adapts (space or comma separated), from: {', '.join(LORA_MODULES)}."},
    )


@dataclass
class LoraModelArguments(ModelSource):
    """run_lora_clm.py's ModelArguments."""

    low_cpu_mem_usage: bool = field(default=False, metadata={"help": "Load without a full random init first."})
    load_meta_device: bool = field(default=False, metadata={"help": "Load the weights onto the device directly."})


@dataclass
class DataArguments(DataSource):
    """run_lora_clm.py's."""

    max_seq_length: Optional[int] = field(default=512, metadata={"help": "Tokens per example (truncated)."})
    validation_split_percentage: Optional[int] = field(
        default=0,
        metadata={"help": "Percent of the training split held out for --do_eval without a validation split."},
    )
    pad_to_max_length: bool = field(default=False, metadata={"help": "Unused (as in optimum-habana's script)."})
    keep_in_memory: bool = field(default=False, metadata={"help": "Keep the loaded data set in memory."})
    dataset_seed: int = field(default=42, metadata={"help": "Unused (as in optimum-habana's script)."})
    dataset_cache_directory: Optional[str] = field(
        default=None, metadata={"help": "Unused (as in optimum-habana's script)."}
    )
    dataset_concatenation: Optional[bool] = field(
        default=False, metadata={"help": "Concatenate the examples and cut them into --max_seq_length blocks."}
    )
    sql_prompt: bool = field(default=False, metadata={"help": "Text-to-SQL prompts (question / context / answer)."})
    chat_prompt: bool = field(default=False, metadata={"help": "Prompts through the tokenizer's chat template."})
    instruction_column_name: Optional[str] = field(default=None, metadata={"help": "Column of the instruction."})
    input_column_name: Optional[str] = field(default=None, metadata={"help": "Column of the input."})
    output_column_name: Optional[str] = field(default=None, metadata={"help": "Column of the answer."})


@dataclass
class FinetuneArguments:
    """run_lora_clm.py's."""

    lora_rank: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: List[str] = field(
        default_factory=lambda: None, metadata={"help": "LoRA / AdaLoRA target modules (default: PEFT's)."}
    )
    train_on_inputs: bool = field(default=True, metadata={"help": "False: the prompt's tokens are not targets."})
    adalora_init_r: int = field(default=12, metadata={"help": "AdaLoRA initial rank."})
    adalora_target_r: int = field(default=4, metadata={"help": "AdaLoRA target rank."})
    adalora_tinit: int = field(default=50, metadata={"help": "AdaLoRA warm-up steps without pruning."})
    adalora_tfinal: int = field(default=100, metadata={"help": "AdaLoRA final steps with the budget fixed."})
    adalora_delta_t: int = field(default=10, metadata={"help": "AdaLoRA steps between rank updates."})
    adalora_orth_reg_weight: float = field(default=0.5, metadata={"help": "AdaLoRA orthogonal regularization."})
    peft_type: str = field(default="lora", metadata={"help": "The PEFT method.", "choices": PEFT_TYPES})
    ia3_target_modules: List[str] = field(default_factory=lambda: None, metadata={"help": "IA3 target modules."})
    feedforward_modules: List[str] = field(default_factory=lambda: None, metadata={"help": "IA3 feed-forward ones."})
    adapter_layers: int = field(default=30, metadata={"help": "llama-adapter layers (from the top)."})
    adapter_len: int = field(default=10, metadata={"help": "llama-adapter prompt tokens."})
    vera_target_modules: List[str] = field(default_factory=lambda: None, metadata={"help": "VeRA target modules."})
    ln_target_modules: List[str] = field(default_factory=lambda: None, metadata={"help": "LN-tuning target modules."})


IMPLEMENTED, WARNED, REFUSED = "implemented", "warned", "refused"
NOT_READ = "optimum-habana's script does not read it either"
# field -> (status, what the scripts do); the same name means the same in both scripts.
SCRIPT_FIELDS = {
    "model_name_or_path": (IMPLEMENTED, "a local folder or .gguf file; none: the built-in model; a Hub name: one error"),
    "model_type": (IMPLEMENTED, "random weights in that model type's default config (with --config_overrides)"),
    "config_overrides": (IMPLEMENTED, "random weights, the config changed (polyfuse: also with --model_name_or_path)"),
    "config_name": (IMPLEMENTED, "a local config folder; without a model: random weights"),
    "tokenizer_name": (IMPLEMENTED, "a local tokenizer folder"),
    "cache_dir": (IMPLEMENTED, "the datasets cache (and Hub cache lookups)"),
    "use_fast_tokenizer": (IMPLEMENTED, "AutoTokenizer(use_fast=)"),
    "model_revision": (IMPLEMENTED, "main only (local files); another revision: one error"),
    "token": (WARNED, "nothing is downloaded"),
    "trust_remote_code": (WARNED, "polyfuse runs its own model code, never a checkpoint's"),
    "torch_dtype": (IMPLEMENTED, "None / auto: the checkpoint's dtype, as optimum-habana's run_clm.py loads it"),
    "use_cache": (IMPLEMENTED, "config.use_cache (False with --gradient_checkpointing); on transformers 5 its own "
                               "TrainingArguments field (default False)"),
    "attn_softmax_bf16": (IMPLEMENTED, "a training argument: eager attention's softmax in bf16 on Gaudi"),
    "use_fused_rope": (IMPLEMENTED, "a training argument: False runs the native rotary"),
    "low_cpu_mem_usage": (IMPLEMENTED, "transformers 4.x from_pretrained(low_cpu_mem_usage=); polyfuse's loader and "
                                       "transformers 5 always load this way"),
    "load_meta_device": (WARNED, "the weights load on the host, then move to the device"),
    "dataset_name": (IMPLEMENTED, "datasets.load_dataset offline (a local folder or a cached Hub data set), or "
                                  "load_from_disk for a save_to_disk folder"),
    "dataset_config_name": (IMPLEMENTED, "load_dataset's configuration name"),
    "train_file": (IMPLEMENTED, "txt / json / jsonl / csv (run_clm.py with no data at all: the bundled tiny corpus)"),
    "validation_file": (IMPLEMENTED, "the validation split"),
    "max_train_samples": (IMPLEMENTED, "the first N training examples"),
    "max_eval_samples": (IMPLEMENTED, "the first N evaluation examples"),
    "streaming": (IMPLEMENTED, "an IterableDataset; the validation split every 100 rows as optimum-habana splits it"),
    "block_size": (IMPLEMENTED, "None: the tokenizer's model_max_length, at most 1024"),
    "overwrite_cache": (IMPLEMENTED, "map(load_from_cache_file=False)"),
    "validation_split_percentage": (IMPLEMENTED, "train[:N%] as validation, train[N%:] to train"),
    "preprocessing_num_workers": (IMPLEMENTED, "map(num_proc=)"),
    "keep_linebreaks": (IMPLEMENTED, "the text loader's keep_linebreaks"),
    "save_last_ckpt": (IMPLEMENTED, "True: the trained model (or adapter) saved in --output_dir; False: not saved"),
    "max_seq_length": (IMPLEMENTED, "truncation length; --dataset_concatenation's block length"),
    "pad_to_max_length": (WARNED, NOT_READ),
    "keep_in_memory": (IMPLEMENTED, "load_dataset(keep_in_memory=)"),
    "dataset_seed": (WARNED, NOT_READ),
    "dataset_cache_directory": (WARNED, NOT_READ),
    "dataset_concatenation": (IMPLEMENTED, "examples concatenated and cut into --max_seq_length blocks"),
    "sql_prompt": (IMPLEMENTED, "optimum-habana's text-to-SQL prompt"),
    "chat_prompt": (IMPLEMENTED, "optimum-habana's prompt through the tokenizer's chat template"),
    "instruction_column_name": (IMPLEMENTED, "renamed to instruction (question with --sql_prompt)"),
    "input_column_name": (IMPLEMENTED, "renamed to input (context with --sql_prompt)"),
    "output_column_name": (IMPLEMENTED, "renamed to output (answer with --sql_prompt)"),
    "lora_rank": (IMPLEMENTED, "PEFT LoraConfig(r=)"),
    "lora_alpha": (IMPLEMENTED, "LoraConfig / AdaLoraConfig lora_alpha"),
    "lora_dropout": (IMPLEMENTED, "LoraConfig / AdaLoraConfig lora_dropout"),
    "lora_target_modules": (IMPLEMENTED, "a list (or comma list); None: PEFT's default for the model"),
    "train_on_inputs": (WARNED, "the prompt's labels are masked, then the collator (DataCollatorForLanguageModeling, "
                                "mlm=False) sets every label from input_ids again, in optimum-habana's script too"),
    "adalora_init_r": (IMPLEMENTED, "AdaLoraConfig(init_r=), --model_impl transformers"),
    "adalora_target_r": (IMPLEMENTED, "AdaLoraConfig(target_r=)"),
    "adalora_tinit": (IMPLEMENTED, "AdaLoraConfig(tinit=)"),
    "adalora_tfinal": (IMPLEMENTED, "AdaLoraConfig(tfinal=)"),
    "adalora_delta_t": (IMPLEMENTED, "AdaLoraConfig(deltaT=)"),
    "adalora_orth_reg_weight": (IMPLEMENTED, "AdaLoraConfig(orth_reg_weight=)"),
    "peft_type": (IMPLEMENTED, "lora, ia3, vera on either --model_impl; adalora, llama-adapter, ln_tuning on "
                               "--model_impl transformers (polyfuse's Llama: one error)"),
    "ia3_target_modules": (IMPLEMENTED, "IA3Config(target_modules=)"),
    "feedforward_modules": (IMPLEMENTED, "IA3Config(feedforward_modules=)"),
    "adapter_layers": (IMPLEMENTED, "AdaptionPromptConfig(adapter_layers=)"),
    "adapter_len": (IMPLEMENTED, "AdaptionPromptConfig(adapter_len=)"),
    "vera_target_modules": (IMPLEMENTED, "VeraConfig(target_modules=)"),
    "ln_target_modules": (IMPLEMENTED, "LNTuningConfig(target_modules=)"),
}  # fmt: skip


def lora_targets(modules) -> Optional[list]:
    """A list from --lora_target_modules given as a list, a comma list, or a mix; None stays None (PEFT's default)."""
    if modules is None:
        return None
    if isinstance(modules, str):
        modules = [modules]
    return [m.strip() for item in modules for m in item.split(",") if m.strip()]


def source_notes(model, data=None, finetune=None) -> list:
    """One line for each given value that changes nothing here (printed as warning: lines)."""
    notes = []
    if model.token:
        notes.append("--token ignored: nothing is downloaded (local files and caches only)")
    if model.trust_remote_code:
        notes.append("--trust_remote_code ignored: polyfuse runs its own model code, never code from a checkpoint")
    if getattr(model, "load_meta_device", False):
        notes.append("--load_meta_device changes nothing: the weights load on the host, then move to the device")
    if finetune is not None and finetune.train_on_inputs is False:
        notes.append(
            "--train_on_inputs False changes nothing: the collator (DataCollatorForLanguageModeling, "
            "mlm=False) sets the labels from input_ids, as in optimum-habana's run_lora_clm.py"
        )
    if data is not None:
        for name, default in (("pad_to_max_length", False), ("dataset_seed", 42), ("dataset_cache_directory", None)):
            if getattr(data, name, default) != default:
                notes.append(f"--{name} changes nothing ({NOT_READ})")
    return notes
