"""FSDP2 through transformers' Trainer: what ``PolyfuseTrainer`` adds to ``--fsdp`` / ``--fsdp_config``.

Sharding is torch's ``fully_shard``, applied by accelerate's FSDP2 preparation as for any transformers model (one
unit per decoder layer: ``DecoderLayer`` / ``LlamaDecoderLayer``; accelerate adds the embedding and the final norm
with the LM head, and the root). polyfuse adds only:

* the checks of what polyfuse cannot honour, each one ``ValueError`` line (run_clm.py prints it once, on rank 0):
  FSDP1 (``fsdp_version`` 1, deprecated by transformers), CPU offload on a CPU run (the parameters are already in
  host memory; FSDP2's offload pins memory, which needs an accelerator), more processes than decoder layers;
* FSDP on the CPU (gloo): accelerate 1.15 enables its FSDP plugin only on accelerators (its ``AcceleratorState``
  keeps ``MULTI_CPU`` and drops the plugin without a word, so the Trainer would run DDP). :func:`enable_on_cpu` sets
  the state as accelerate does on a GPU (distributed type FSDP, the plugin, its mixed precision) so that the CPU
  runs the same ``fully_shard`` path; this is what the CPU tests exercise;
* the full (consolidated) state dict gathered on every rank for a polyfuse checkpoint in transformers' format;
* :func:`agree_ranks` (run_clm.py, after loading): one rank's load error, or ranks given different models or
  arguments, become one error on every rank instead of a peer waiting in a collective;
* :func:`prepare_zero3`: ``--deepspeed`` with ZeRO-3 (transformers' integration) and the fused paths' weight reads;
* :func:`sync_trainable` (``PolyfuseTrainer.train``, before sharding): trainable parameters that differ between ranks
  (a PEFT adapter drawn from each process's own random state) are replaced by rank 0's, with one warning, as DDP
  broadcasts rank 0's parameters when it wraps a model; FSDP2 shards each rank's own copy as it is.

The model side (models/decoder.py): ``DecoderForCausalLM._no_split_modules`` / ``base_model_prefix`` for
accelerate, and the final norm and the LM head's fused loss called as modules, so FSDP2's hooks unshard them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def fsdp_enabled(args) -> bool:
    """Whether the arguments ask for FSDP (transformers 5: ``fsdp_plugin_args``; 4.x: a non-empty ``fsdp``)."""
    plugin = getattr(args, "fsdp_plugin_args", None)
    if plugin is not None:
        return True
    return bool(getattr(args, "fsdp", None)) and not hasattr(args, "fsdp_plugin_args")


def fsdp_version(args) -> int:
    plugin = getattr(args, "fsdp_plugin_args", None)
    if plugin is not None:
        return int(plugin.get("fsdp_version", 1))
    config = getattr(args, "fsdp_config", None) or {}
    return int(config.get("version", config.get("fsdp_version", 1)))


def _cpu_offload(args) -> bool:
    plugin = getattr(args, "fsdp_plugin_args", None)
    if plugin is not None:
        return bool(plugin.get("cpu_offload", False))
    fsdp = getattr(args, "fsdp", None)
    config = getattr(args, "fsdp_config", None) or {}
    options = fsdp.split() if isinstance(fsdp, str) else [getattr(o, "value", o) for o in (fsdp or [])]
    return bool(config.get("cpu_offload")) or "offload" in options


def validate_args(args) -> None:
    """One ``ValueError`` line for an FSDP setting polyfuse cannot honour (called by PolyfuseTrainingArguments once
    transformers has parsed ``fsdp`` / ``fsdp_config``)."""
    if not fsdp_enabled(args):
        return
    version = fsdp_version(args)
    if version != 2:
        raise ValueError(
            f"--fsdp: polyfuse trains with FSDP2 only; fsdp_config asks for version {version} (FSDP1, deprecated by "
            'transformers): put "fsdp_version": 2 in --fsdp_config (docs/training.md)'
        )
    if _cpu_offload(args) and args.device.type == "cpu":
        raise ValueError(
            "--fsdp offload / fsdp_config cpu_offload: this run trains on the CPU, where the parameters already are; "
            "there is nothing to offload (FSDP2's CPU offload pins host memory for an accelerator)"
        )


def layer_count(model: nn.Module) -> Optional[int]:
    """The decoder layers FSDP2 wraps one by one (the config's ``num_hidden_layers``; PEFT wrappers pass it on)."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    return int(n) if isinstance(n, int) else None


def check_model(model: nn.Module, args) -> None:
    """More processes than decoder layers: refused (issue 13's bad input), before anything is sharded."""
    if not fsdp_enabled(args):
        return
    layers, world = layer_count(model), int(args.world_size)
    if layers is not None and world > layers:
        raise ValueError(
            f"--fsdp: {world} processes but the model has {layers} decoder layer(s) to shard; FSDP2 shards the model "
            f"one decoder layer per unit: use at most {layers} processes"
        )


def enable_on_cpu(trainer) -> bool:
    """After ``Trainer.create_accelerator_and_postprocess``: on a CPU run (accelerate's ``MULTI_CPU``, gloo) with FSDP
    asked for, make accelerate's state FSDP as it does on accelerators (accelerate 1.15 drops the plugin there), and
    redo the Trainer's FSDP checks it skipped. Returns True when it did."""
    from accelerate.utils import DistributedType

    args = trainer.args
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    state = trainer.accelerator.state
    if plugin_args is None or getattr(state, "fsdp_plugin", None) is not None:
        return False
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState.__init__ does
    trainer.is_fsdp_enabled = True
    # What Trainer.create_accelerator_and_postprocess checks once FSDP is on (transformers 5.24).
    if plugin.activation_checkpointing and getattr(args, "activation_checkpointing", False):
        raise ValueError(
            "fsdp_config activation_checkpointing and --activation_checkpointing / --gradient_checkpointing can't "
            "both be on; use one"
        )
    if getattr(args, "save_only_model", False) and "SHARDED_STATE_DICT" in str(plugin.state_dict_type):
        raise ValueError("save_only_model option is not compatible with FSDP state dict type 'SHARDED_STATE_DICT'")
    return True


def sharded_state_dict_type(trainer) -> bool:
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return plugin is not None and "SHARDED_STATE_DICT" in str(plugin.state_dict_type)


def full_state_dict(model: nn.Module) -> dict:
    """The whole model's state dict in host memory on rank 0 (empty on the other ranks), gathered from the FSDP2
    shards; every rank must call it (it runs collectives)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded(model: nn.Module) -> bool:
    """True when FSDP2 has wrapped ``model`` or one of its modules."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers' infixes (activation checkpointing, torch.compile)."""
    return name.replace("._checkpoint_wrapped_module", "").replace("_orig_mod.", "")


def parameters_of(model: nn.Module, state_dict: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of ``state_dict`` for the model's parameters, in ``named_parameters`` order (buffers and the
    tied head's second name left out, as ``named_parameters`` does)."""
    names = [canonical_name(n) for n, _ in model.named_parameters()]
    missing = [n for n in names if n not in state_dict]
    if missing:
        raise KeyError(f"the gathered state dict lacks {missing[:3]}{'...' if len(missing) > 3 else ''}")
    return [(n, state_dict[n]) for n in names]


# Arguments every rank of one run must share (a rank started with others would train another model, or hang).
_SHARED_ARGS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "num_train_epochs", "learning_rate",
    "seed", "bf16", "fp16", "fsdp_config", "gradient_checkpointing", "activation_checkpointing", "deepspeed",
)  # fmt: skip


def run_fingerprint(model: Optional[nn.Module], args) -> str:
    """What the ranks compare before training: the model (class, parameter count, config) and the shared arguments."""
    import hashlib

    def digest(text: str) -> str:
        return hashlib.sha1(text.encode()).hexdigest()[:8]

    shared = repr([(k, repr(getattr(args, k, None))) for k in _SHARED_ARGS]) + repr(fsdp_enabled(args))
    if model is None:
        return f"no model, arguments {digest(shared)}"
    config = getattr(model, "config", None)
    text = config.to_json_string() if hasattr(config, "to_json_string") else repr(config)
    n = sum(p.numel() for p in model.parameters())
    return f"{type(model).__name__} of {n} parameters (config {digest(text)}), arguments {digest(shared)}"


def agree_ranks(args, error: Optional[BaseException], model: Optional[nn.Module]) -> None:
    """After every rank built its model: the ranks exchange how it went (polyfuse.distributed.agree). One rank's
    failure, or ranks that built different models or were given different arguments, raise the same one-line error
    on every rank, so none waits in a collective for a peer that will not come. One process: re-raises ``error``."""
    import torch.distributed as dist

    from polyfuse.distributed import TPContext, agree

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        if error is not None:
            raise error
        return
    ctx = TPContext(rank=dist.get_rank(), world_size=dist.get_world_size(), group=dist.group.WORLD)
    agree(ctx, error, run_fingerprint(model, args))


def _comm_device() -> torch.device:
    """Where the default process group's collectives take tensors: host memory for gloo, the current accelerator
    for NCCL / HCCL."""
    import torch.distributed as dist

    backend = str(dist.get_backend()).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in backend:
        return torch.device("hpu")
    return torch.device("cpu")


@torch.no_grad()
def sync_trainable(model: nn.Module, args) -> int:
    """Under FSDP2 with several processes, before sharding: every rank compares a checksum (sum and sum of squares, in
    float64) of each trainable parameter with rank 0's; where any rank differs, rank 0's values are broadcast to all
    and rank 0 prints one warning naming how many tensors (DDP broadcasts rank 0's parameters when it wraps a model;
    FSDP2 shards each rank's own copy, so ranks that drew a PEFT adapter from their own random state would train a mix
    of the ranks' shards). Returns the number of tensors replaced (0 without FSDP, with one process, or when parameters
    are not materialized yet: meta tensors, which accelerate's RAM-efficient loading fills from rank 0 itself)."""
    import torch.distributed as dist

    if not fsdp_enabled(args) or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return 0
    params = [p for p in model.parameters() if p.requires_grad]
    if not params or any(p.is_meta or type(p.data) is not torch.Tensor for p in params):
        return 0  # meta (filled by accelerate from rank 0) or already sharded (DTensor)
    dev = _comm_device()
    sums = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for p in params]).to(dev)
    ref = sums.clone()
    dist.broadcast(ref, src=0)
    differs = (sums != ref).any(dim=1).to(torch.int32)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    replaced = [p for p, d in zip(params, differs.tolist()) if d]
    for p in replaced:
        t = p.detach().to(dev)
        dist.broadcast(t, src=0)
        p.copy_(t)
    if replaced and dist.get_rank() == 0:
        print(
            f"warning: --fsdp: {len(replaced)} of {len(params)} trainable tensors differed between the ranks (an "
            "adapter initialized without a common seed?): rank 0's values were broadcast to every rank before "
            "sharding",
            flush=True,
        )
    return len(replaced)


def prepare_zero3(model: nn.Module, args) -> bool:
    """``--deepspeed`` with ZeRO stage 3 (passed through to transformers' integration): ZeRO-3 gathers a module's
    parameters when that module is called, but the fused paths read weights inside a larger call (polyfuse's and the
    patched decoder layer read their norms' and projections' weights; the patched causal LM reads ``lm_head.weight``
    for the fused loss). So each decoder layer becomes a ZeRO-3 leaf module (its whole subtree gathered at its call)
    and a head read outside its own call is registered with the model's call. Not run yet (no DeepSpeed here)."""
    config = getattr(args, "hf_deepspeed_config", None)
    if config is None or not config.is_zero3():
        return False
    import deepspeed
    from deepspeed.utils import set_z3_leaf_modules

    layers = sorted({type(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")}, key=str)
    if layers:
        set_z3_leaf_modules(model, layers)
    from polyfuse.models.decoder import LMHead

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)  # a packed head (--quant_lm_head) holds buffers, no parameter
    if isinstance(weight, torch.nn.Parameter) and not isinstance(head, LMHead):
        deepspeed.zero.register_external_parameter(model, weight)  # a patched transformers model reads head.weight
    return True
