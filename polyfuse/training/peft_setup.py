"""PEFT adapters for examples/run_clm.py (``--lora_rank``) and examples/run_lora_clm.py (``--peft_type``), built as
optimum-habana's run_lora_clm.py builds them: LoRA, AdaLoRA, IA3, llama-adapter (AdaptionPrompt), VeRA, LN-tuning.
polyfuse's own Llama takes LoRA, IA3 and VeRA (its q/k/v and gate/up slices are nn.Linear modules PEFT wraps); the
others need transformers' Llama (``--model_impl transformers``). Failures are one ValueError line."""

from __future__ import annotations

from transformers import TrainerCallback

from polyfuse.training.clm_args import LORA_MODULES, lora_targets


POLYFUSE_PEFT = ("lora", "ia3", "vera")


def require_peft(flag: str = "--lora_rank") -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ValueError(
            f"{flag} needs peft: pip install peft (or pip install -e '.[lora]' in a polyfuse clone)"
        ) from None


def check_lora_modules(lora) -> None:
    """run_clm.py's LoRA: a rank >= 0, dropout in [0, 1), targets among the Llama projections polyfuse exposes."""
    if lora.lora_rank < 0:
        raise ValueError(f"--lora_rank must be >= 0 (0: no LoRA), got {lora.lora_rank}")
    if lora.lora_rank == 0:
        return
    check_dropout(lora.lora_dropout)
    targets = lora_targets(lora.lora_target_modules) or []
    unknown = [m for m in targets if m not in LORA_MODULES]
    if unknown or not targets:
        raise ValueError(f"--lora_target_modules: unknown module {', '.join(map(repr, unknown)) or 'list (empty)'}; "
                         f"choose from {', '.join(LORA_MODULES)}")  # fmt: skip
    require_peft()


def check_dropout(p: float) -> None:
    if not 0 <= p < 1:
        raise ValueError(f"--lora_dropout must be in [0, 1), got {p}")


def check_finetune(finetune, model_impl: str) -> None:
    """run_lora_clm.py's FinetuneArguments."""
    if finetune.peft_type not in ("lora", "ia3", "adalora", "llama-adapter", "vera", "ln_tuning"):
        raise ValueError(f"--peft_type {finetune.peft_type!r}: not one of lora, ia3, adalora, llama-adapter, vera, "
                         "ln_tuning")  # fmt: skip
    if model_impl == "polyfuse" and finetune.peft_type not in POLYFUSE_PEFT:
        raise ValueError(f"--peft_type {finetune.peft_type} runs on transformers' Llama only: use --model_impl "
                         f"transformers (polyfuse's Llama takes {', '.join(POLYFUSE_PEFT)})")  # fmt: skip
    if finetune.peft_type in ("lora", "adalora"):
        if finetune.lora_rank <= 0:
            raise ValueError(f"--lora_rank must be > 0, got {finetune.lora_rank}")
        check_dropout(finetune.lora_dropout)
    require_peft("--peft_type")


def peft_config(finetune, max_steps: int):
    """The PEFT config run_lora_clm.py builds for --peft_type (AdaLoRA's total_step is the run's step count)."""
    import peft

    task = peft.TaskType.CAUSAL_LM
    kind = finetune.peft_type
    targets = lora_targets(finetune.lora_target_modules)
    if kind == "lora":
        return peft.LoraConfig(r=finetune.lora_rank, lora_alpha=finetune.lora_alpha, lora_dropout=finetune.lora_dropout,
                               target_modules=targets, bias="none", task_type=task)  # fmt: skip
    if kind == "adalora":
        return peft.AdaLoraConfig(
            init_r=finetune.adalora_init_r, target_r=finetune.adalora_target_r, tinit=finetune.adalora_tinit,
            tfinal=finetune.adalora_tfinal, deltaT=finetune.adalora_delta_t, lora_alpha=finetune.lora_alpha,
            lora_dropout=finetune.lora_dropout, target_modules=targets, orth_reg_weight=finetune.adalora_orth_reg_weight,
            bias="none", task_type=task, total_step=max(max_steps, 1),
        )  # fmt: skip
    if kind == "ia3":
        return peft.IA3Config(target_modules=lora_targets(finetune.ia3_target_modules),
                              feedforward_modules=lora_targets(finetune.feedforward_modules), task_type=task)  # fmt: skip
    if kind == "llama-adapter":
        return peft.AdaptionPromptConfig(adapter_layers=finetune.adapter_layers, adapter_len=finetune.adapter_len,
                                         task_type=task)  # fmt: skip
    if kind == "vera":
        return peft.VeraConfig(target_modules=lora_targets(finetune.vera_target_modules), task_type=task,
                               init_weights=False)  # fmt: skip
    return peft.LNTuningConfig(target_modules=lora_targets(finetune.ln_target_modules), task_type=task)


def run_clm_lora_config(lora):
    """run_clm.py's --lora_rank adapter."""
    import peft

    return peft.LoraConfig(r=lora.lora_rank, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                           target_modules=lora_targets(lora.lora_target_modules), bias="none",
                           task_type=peft.TaskType.CAUSAL_LM)  # fmt: skip


def add_peft(model, config, targs, base_name: str):
    """The model wrapped by PEFT (its base weights frozen), as optimum-habana's run_lora_clm.py does."""
    from peft import get_peft_model
    from transformers import set_seed

    if targs.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        # transformers' reentrant checkpointing (the 4.x default) needs an input that requires grad, and the frozen
        # embedding gives none (run_lora_clm.py does the same); polyfuse's checkpointing is non-reentrant.
        model.enable_input_require_grads()
    # The adapter starts random (torch's default generator is seeded at random per process, and Trainer seeds only
    # after this): --seed makes it the same on every run and every rank; FSDP2 shards each rank's own copy
    # unsynchronized, so ranks drawing different adapters would train a mix of them.
    set_seed(targs.seed)
    model.name_or_path = base_name  # adapter_config.json's base_model_name_or_path (PEFT reads it)
    try:
        model = get_peft_model(model, config)
    except (ValueError, KeyError, AttributeError) as e:
        raise ValueError(
            f"PEFT ({type(config).__name__}): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    model.print_trainable_parameters()
    return model


class AdaLoraSteps(TrainerCallback):
    """AdaLoRA's rank budget: ``update_and_allocate(step)`` after each optimizer step, while the gradients it scores
    the ranks by are still there (PEFT's loop; optimum-habana calls it after each backward)."""

    def __init__(self, model):
        self.model = model

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.model.base_model.update_and_allocate(state.global_step)
