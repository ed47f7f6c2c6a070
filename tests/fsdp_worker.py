"""One rank of tests/test_fsdp.py: PolyfuseTrainer with FSDP2 (accelerate's plugin, ``fully_shard`` per decoder
layer) on the CPU, gloo, under ``torchrun --nproc-per-node 2``:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/fsdp_worker.py OUT_DIR [CASE ...]

Cases (``CASES``): ``polyfuse`` (polyfuse's Llama, tied embeddings) and ``transformers`` (a patched transformers
Llama, untied) with SHARDED_STATE_DICT checkpoints, ``polyfuse_full`` with FULL_STATE_DICT ones,
``polyfuse_unsynced`` whose ranks start from different weights (``UNSYNCED``). Each: a tiny Llama
with the same weights on every rank, gradient checkpointing on, AdamW steps (6) at a global batch of 4 rows (2 per
rank), a checkpoint at step 2, then ``save_model`` (the final save: one consolidated transformers checkpoint); then
a second trainer, built from other weights, resumes from checkpoint-2 and trains to step 4. Every rank writes
OUT_DIR/rank<R>.json: per case the losses, the resumed run's, the calls of the fused linear cross-entropy, the
modules FSDP2 wrapped, the kernels report. ``run_case(case, out, world=1)`` is the same run in one process (the
test's reference).
"""

from __future__ import annotations

import json
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
from helpers import tiny_config, tiny_llama  # noqa: E402
from transformers import default_data_collator  # noqa: E402

from polyfuse.training import PolyfuseTrainer, PolyfuseTrainingArguments  # noqa: E402


CASES = {  # case: (model implementation, fsdp_config state_dict_type)
    "polyfuse": ("polyfuse", "SHARDED_STATE_DICT"),
    "transformers": ("transformers", "SHARDED_STATE_DICT"),
    "polyfuse_full": ("polyfuse", "FULL_STATE_DICT"),
    "polyfuse_unsynced": ("polyfuse", "SHARDED_STATE_DICT"),
}
# Cases whose ranks start from different weights (seed = rank, as an adapter drawn without a common seed would):
# PolyfuseTrainer.train replaces them by rank 0's before sharding (polyfuse.training.fsdp.sync_trainable), so the run
# equals the one-process run from rank 0's weights (seed 0).
UNSYNCED = ("polyfuse_unsynced",)
GLOBAL_BATCH, STEPS, SEQ, ROWS = 4, 6, 16, 24


def build(impl: str, seed: int):
    if impl == "polyfuse":
        from polyfuse.models.llama import LlamaForCausalLM

        cfg = tiny_config(vocab_size=256, num_key_value_heads=2, tie_word_embeddings=True)
        return LlamaForCausalLM.from_config(cfg, seed=seed, training=True)
    return tiny_llama(seed=seed)


def dataset() -> list:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 256, (ROWS, SEQ), generator=g).tolist()
    return [{"input_ids": r, "attention_mask": [1] * SEQ, "labels": r} for r in ids]


def arguments(out: str, world: int, state_dict_type: str) -> PolyfuseTrainingArguments:
    fsdp = {}
    if world > 1:
        fsdp = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2, "state_dict_type": state_dict_type}}
    return PolyfuseTrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH // world, learning_rate=1e-3,
        logging_steps=1, save_strategy="steps", save_steps=2, report_to="none", disable_tqdm=True, seed=0,
        gradient_checkpointing=True, **fsdp,
    )  # fmt: skip


def count_calls(kernels, op: str) -> list:
    calls = []
    real = getattr(kernels, op)

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    setattr(kernels, op, counted)
    return calls


def losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_case(case: str, out: str, world: int) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from polyfuse.training import fsdp

    impl, sd_type = CASES[case]
    seed = int(os.environ.get("RANK", "0")) if case in UNSYNCED else 0
    trainer = PolyfuseTrainer(
        model=build(impl, seed=seed), args=arguments(os.path.join(out, case), world, sd_type),
        train_dataset=dataset(), data_collator=default_data_collator,
    )  # fmt: skip
    lce = count_calls(trainer.polyfuse_kernels, "linear_cross_entropy")
    replaced, sync = [], fsdp.sync_trainable
    fsdp.sync_trainable = lambda *a: replaced.append(sync(*a)) or replaced[-1]
    try:
        trainer.train()
    finally:
        fsdp.sync_trainable = sync
    model = trainer.model_wrapped
    units = sorted({type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)})
    layer_units = sum(isinstance(m, FSDPModule) and "DecoderLayer" in type(m).__name__ for m in model.modules())
    result = {
        "losses": losses(trainer),
        "fused_ce_calls": len(lce),  # one per forward: the chunked loss, never the logits
        "fsdp": bool(getattr(trainer, "is_fsdp_enabled", False)) and trainer.accelerator.is_fsdp2,
        "fsdp_units": units,
        "layer_units": layer_units,
        "report": trainer._polyfuse_report,
        "checkpoint_files": sorted(os.listdir(os.path.join(out, case, "checkpoint-2"))),
        "synced": replaced,  # tensors sync_trainable replaced, per train() (none without FSDP)
        # trainable tensors whose values depend on the seed (the norms start at one whatever it is)
        "seeded": sum(
            not torch.equal(a, b) for a, b in zip(build(impl, seed=0).parameters(), build(impl, seed=1).parameters())
        ),
    }
    trainer.save_model(os.path.join(out, case, "final"))  # the final save: consolidated, whatever the checkpoints are
    # Resume: a trainer on other weights picks up checkpoint-2 (model, optimizer, scheduler, data position).
    resumed = PolyfuseTrainer(
        model=build(impl, seed=1), args=arguments(os.path.join(out, case + "_resumed"), world, sd_type),
        train_dataset=dataset(), data_collator=default_data_collator,
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=os.path.join(out, case, "checkpoint-2"))
    result["resumed_losses"] = losses(resumed)
    resumed.save_model(os.path.join(out, case + "_resumed", "final"))
    return result


def main(out: str, cases: list) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = {case: run_case(case, out, int(os.environ["WORLD_SIZE"])) for case in cases}
    rank = dist.get_rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(CASES))
    os._exit(0)  # skip the interpreter teardown (gloo can abort when the peer exits at the same moment)
