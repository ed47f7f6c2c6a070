"""polyfuse's causal LMs as transformers ``PreTrainedModel`` + ``GenerationMixin`` subclasses, so clients that check
or use that surface (``pipeline``, TRL's trainers, lm-eval's ``HFLM``, PEFT, the Trainer) take them unchanged:
``config``, ``generation_config`` (from the checkpoint), ``can_generate``, ``add_model_tags``, ``base_model``,
``num_parameters``, ``resize_token_embeddings``, ``push_to_hub`` and the rest are transformers' own.

What polyfuse does its own way, with transformers' signatures:

* ``from_pretrained``: the loader builds the model on the meta device and copies every weight in (never a random
  init); transformers' keywords (``dtype`` / ``torch_dtype``, ``device_map``, ``revision``, ...) are mapped by
  loader/hf_args.py, refused where polyfuse cannot honour them.
* ``save_pretrained``: loader/save.py (weights in transformers' names, generation_config.json, the tokenizer the
  model was loaded with); ``push_to_hub`` calls it like transformers' models.
* ``generate``: polyfuse's engine (polyfuse/generation) with transformers' arguments and defaults.
* weight initialization: none at build; ``_init_weights`` is transformers' only for modules made later
  (``resize_token_embeddings``' new rows).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel

from polyfuse.checkpoint.hub import local_checkpoint
from polyfuse.compat import TIED_LM_HEAD
from polyfuse.core import kernel_options
from polyfuse.loader import load as loading
from polyfuse.loader import save as saving
from polyfuse.loader.hf_args import load_request


# transformers' generate() arguments after ``inputs``, in its positional order.
_GENERATE_ARGS = (
    "generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
    "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
)  # fmt: skip
# Those polyfuse's engine does not implement: refused when given.
_UNSUPPORTED_GENERATE = ("prefix_allowed_tokens_fn", "negative_prompt_ids", "negative_prompt_attention_mask")


def load_pretrained(pick_class, path, gguf_file, dtype, device, options: dict, hf_kwargs: dict):
    """A model from ``path`` (a folder or a Hub repo id): ``pick_class(folder, gguf_file)`` names the family;
    ``options``: polyfuse's own loading options; ``hf_kwargs``: transformers' keywords."""
    hf_kwargs = dict(hf_kwargs)
    kernel = {name: hf_kwargs.pop(name) for name in list(hf_kwargs) if name in kernel_options.FIELDS}
    if kernel:  # kernel options (core/kernel_options.py: int4_a8=True, pdl=False, ...) join the run's flags
        options = {**options, "flags": kernel_options.merge(options.get("flags"), kernel)}
    req = load_request(dtype, device, hf_kwargs)
    hub = dict(req.hub)
    folder = local_checkpoint(path, gguf_file, hub.pop("revision", None), hub.pop("subfolder", ""), **hub)
    cls = pick_class(folder, gguf_file)
    model = loading.from_pretrained(
        cls, folder, gguf_file, req.dtype, req.device, config=req.config, config_updates=req.config_updates,
        **options,
    )  # fmt: skip
    model.name_or_path = model.config._name_or_path = os.fspath(path)  # a Hub id stays one (PEFT records it)
    return model


class HFCausalLMBase(PreTrainedModel, GenerationMixin):
    """The transformers surface shared by the families (``DecoderForCausalLM`` subclasses it)."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _tied_weights_keys = TIED_LM_HEAD
    use_kernels = False  # transformers' hub-kernels switch (read by PreTrainedModel.train): polyfuse has its own
    is_parallelizable = False
    _supports_sdpa = True  # what polyfuse's attention op computes, whichever kernel the registry picks

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        """Any requested attention implementation is accepted and changes nothing: the op registry picks the
        kernel (``flags``/``overrides``), with the same numbers as transformers' sdpa and eager."""
        return attn_implementation or "sdpa"

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, gguf_file=None, dtype=None, device=None, flags=None,
                        overrides="", training=False, quant=None, progress=None, quant_lm_head=False,
                        **kwargs):  # fmt: skip  # size: transformers' signature, plus polyfuse's options
        options = dict(flags=flags, overrides=overrides, training=training, quant=quant, progress=progress,
                       quant_lm_head=quant_lm_head)  # fmt: skip
        return load_pretrained(lambda folder, gguf: cls, pretrained_model_name_or_path, gguf_file, dtype, device,
                               options, kwargs)  # fmt: skip

    @classmethod
    def _from_config(cls, config, **kwargs):
        """transformers' ``AutoModelForCausalLM.from_config`` path (with ``register_auto_classes``): polyfuse's
        ``from_config`` (transformers' random initialization, kernels resolved)."""
        dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None) or torch.float32
        kwargs.pop("attn_implementation", None)
        if kwargs:
            raise TypeError(f"from_config() got an unexpected keyword argument {next(iter(kwargs))!r}")
        return cls.from_config(config, dtype=loading.dtype_of(dtype) or torch.float32)

    def save_pretrained(self, save_directory, is_main_process: bool = True, state_dict=None, push_to_hub=False,
                        max_shard_size=None, safe_serialization=True, variant=None, params=None,
                        **kwargs) -> None:  # fmt: skip  # transformers' signature
        """transformers' ``save_pretrained``: safetensors only; ``state_dict`` (the model's own names, as the Trainer
        passes it) or ``params`` replace the parameters written; ``push_to_hub`` then uploads the folder's model."""
        if not safe_serialization or variant is not None:
            raise ValueError("polyfuse saves safetensors only (safe_serialization=True, no variant)")
        if not is_main_process:
            return
        shard = 4 << 30 if max_shard_size is None else _bytes(max_shard_size)
        if state_dict is not None and params is None:
            names = {n for n, _ in self.named_parameters()}
            params = [(n, t) for n, t in state_dict.items() if n in names]
        if push_to_hub:
            repo = kwargs.pop("repo_id", None) or os.path.basename(os.path.normpath(os.fspath(save_directory)))
            saving.save_pretrained(self, save_directory, max_shard_bytes=shard, params=params)
            return self.push_to_hub(repo, max_shard_size=max_shard_size or "5GB", **kwargs)
        for key in ("token", "save_function", "save_peft_format", "commit_message", "private", "create_pr"):
            kwargs.pop(key, None)  # push-to-hub bookkeeping, meaningless for a local save
        if kwargs:
            raise TypeError(f"save_pretrained() got an unexpected keyword argument {next(iter(kwargs))!r}")
        saving.save_pretrained(self, save_directory, max_shard_bytes=shard, params=params)

    # -- generation ----------------------------------------------------------------------------------------------

    def generate(self, inputs=None, *args, **kwargs):
        """transformers' ``generate(inputs, generation_config, logits_processor, stopping_criteria, ...,
        **kwargs)`` (its arguments, semantics and defaults from ``self.generation_config``) run by polyfuse's engine
        (polyfuse/generation/generate.py). polyfuse's own form ``generate(input_ids, attention_mask, ...)`` works
        too: a tensor second argument is the attention mask."""
        from polyfuse.generation.generate import generate

        if args and isinstance(args[0], torch.Tensor):
            kwargs["attention_mask"], args = args[0], args[1:]
        if len(args) > len(_GENERATE_ARGS):
            raise TypeError(f"generate() takes at most {len(_GENERATE_ARGS) + 1} positional arguments")
        for name, value in zip(_GENERATE_ARGS, args):
            if name in kwargs:
                raise TypeError(f"generate() got multiple values for argument {name!r}")
            kwargs[name] = value
        for name in _UNSUPPORTED_GENERATE:
            if kwargs.pop(name, None) is not None:
                raise TypeError(f"generate({name}=...) is not supported by polyfuse's engine")
        if kwargs.pop("synced_gpus", None):
            raise TypeError("generate(synced_gpus=True) is not supported: polyfuse's ranks run one model together")
        input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
        if input_ids is None:
            raise ValueError("generate() needs input_ids (polyfuse's models take token ids, not inputs_embeds)")
        attention_mask = kwargs.pop("attention_mask", None)
        for name in ("generation_config", "logits_processor", "stopping_criteria", "streamer", "assistant_model"):
            if name in kwargs and kwargs[name] is None:
                del kwargs[name]  # transformers' default: not given
        path = kwargs.get("speculative_model")
        if isinstance(path, (str, os.PathLike)):  # EAGLE-3 heads (or a draft model) by folder: loaded once, kept
            load = type(self).speculative_loader
            kwargs["speculative_model"] = load(self, str(path), kwargs.get("speculative_method"))
        return generate(self, input_ids, attention_mask, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, **kwargs) -> dict:
        """transformers' hook: PEFT's ``PeftModelForCausalLM`` reads it when it wraps a model (LoRA with
        ``task_type="CAUSAL_LM"``). polyfuse's ``generate`` never calls it (the engine feeds its own steps)."""
        return {"input_ids": input_ids, **kwargs}

    # -- weights made after the build -------------------------------------------------------------------------------

    def init_weights(self):
        """No initialization at build: the loader copies every weight in, ``from_config`` draws its own."""
        self.tie_weights()

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' initialization of a module made after the build (``resize_token_embeddings``' rows with
        ``mean_resizing=False``): normal(0, initializer_range), biases and the padding row at zero."""
        std = getattr(self.config, "initializer_range", 0.02)
        with torch.no_grad():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def set_output_embeddings(self, value: nn.Module) -> None:
        """A plain ``nn.Linear`` (transformers' resized head) takes the class of the head it replaces (polyfuse's
        ``LMHead``: the same module, whose call also computes the fused loss)."""
        head_cls = type(self.lm_head)
        if type(value) is nn.Linear and issubclass(head_cls, nn.Linear) and head_cls.__init__ is nn.Linear.__init__:
            value.__class__ = head_cls
        self.lm_head = value

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """transformers' resize; captured step graphs and the KV cache (sized by the old shapes) are dropped."""
        if getattr(self, "vocab", None) is not None:
            raise ValueError("a tensor-parallel model cannot be resized (its head holds one rank's rows)")
        out = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.steps, self.cache = None, None
        return out


def _bytes(size) -> int:
    if isinstance(size, int):
        return size
    from transformers.utils.hub import convert_file_size_to_int

    return convert_file_size_to_int(size)
