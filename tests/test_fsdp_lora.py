"""LoRA through PEFT under FSDP2 on the CPU: ``torchrun examples/run_clm.py --lora_rank ... --fsdp`` on 2 gloo
processes against the same run in one process (docs/training.md, "LoRA (PEFT)" and "Several processes: FSDP2").

polyfuse's Llama (``--model_impl polyfuse`` on tests/test_training.py's tiny two-layer Llama, which
tests/test_lora.py's run_clm.py tests use too) with PEFT LoRA on q, v, o, up and down (k and gate stay bare slices, so
the fused qkv / gate_up GEMMs run ``lora_linear`` with some parts adapted), dropout 0 (both runs deterministic),
gradient checkpointing on, 5 AdamW steps at a global batch of 2 rows (1 per rank against 2), a checkpoint at step 2,
with both FSDP2 state dict types:

* the loss and the gradient norm of every step equal the one-process run's within 1e-5 relative (fp32: the runs
  differ only in the order of the sums, FSDP2's gradient reduce-scatter of two one-row batches against one two-row
  batch; measured <= 3e-7). The norm as well as the loss: AdamW's steps hardly change with the gradient's scale;
* the checkpoint is FSDP2's (accelerate's DCP shards or its consolidated ``pytorch_model_fsdp.bin``: the run was
  sharded, not DDP);
* the final folder holds PEFT's adapter (adapter_config.json + adapter_model.safetensors, no base weights) with the
  one-process run's config and tensors within (atol 1e-5, rtol 1e-5). AdamW moves every entry by up to its lr (1e-2)
  per step whatever the size of its gradient, so where a gradient is near zero the order of the sums shows in the
  weight at a fraction of the lr: measured <= 8e-7 (8e-5 lr) on entries up to 0.19; the tolerance is 1e-3 lr, where a
  wrong gradient or a rank's own adapter is off by about the lr or more (the ranks' different draws: by 0.3);
* loaded with ``PeftModel.from_pretrained`` onto a fresh base model (polyfuse's and transformers'), it gives the
  one-process adapter's logits within (1e-5, 1e-5) (measured 1.3e-7) and its greedy tokens, where the base model
  without the adapter is more than 1e-3 away (measured 0.24: the adapter was trained and loaded, not dropped).

The one-process run is the reference: a wrong gradient under FSDP2, or ranks starting from different adapters (what
run_clm.py did before it seeded PEFT's random ``lora_A`` with --seed: each rank kept its shard of its own draw) fail
these checks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from helpers import dist_env, one_thread, run_session, torchrun_cmd  # noqa: F401  (one_thread: autouse fixture)

from polyfuse.training.arguments import cpu_fsdp_unsupported


peft = pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(cpu_fsdp_unsupported() is not None, reason=str(cpu_fsdp_unsupported()))

from peft import PeftModel  # noqa: E402

from polyfuse.models import AutoModelForCausalLM as PfAuto  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
RUN_CLM = str(ROOT / "examples" / "run_clm.py")
STEPS = 5
LOSS_RTOL = 1e-5  # tests/test_fsdp.py's
ADAPTER_TOL = {"atol": 1e-5, "rtol": 1e-5}
LOGITS_TOL = {"atol": 1e-5, "rtol": 1e-5}
TARGETS = "q_proj,v_proj,o_proj,up_proj,down_proj"
CLM = ["--model_impl", "polyfuse", "--max_steps", STEPS, "--block_size", "16", "--logging_steps", "1",
       "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "steps", "--save_steps", "2",
       "--learning_rate", "1e-2", "--gradient_checkpointing", "True", "--lora_rank", "4", "--lora_alpha", "8",
       "--lora_dropout", "0", "--lora_target_modules", TARGETS]  # fmt: skip
FSDP_FILES = {"SHARDED_STATE_DICT": "pytorch_model_fsdp_0", "FULL_STATE_DICT": "pytorch_model_fsdp.bin"}


def _run(cmd):
    p = run_session([str(a) for a in cmd], 300, dist_env(), ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from test_training import _tiny_model_folder

    return _tiny_model_folder(tmp_path_factory.mktemp("lora_fsdp_model"))


@pytest.fixture(scope="module")
def single(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_single")
    t0 = time.perf_counter()
    _run([sys.executable, RUN_CLM, "--model_name_or_path", tiny_model, *CLM, "--per_device_train_batch_size", "2",
          "--output_dir", out])  # fmt: skip
    print(f"LoRA, one process: {time.perf_counter() - t0:.1f} s")
    return out


def _logged(folder: Path, key: str) -> list:
    log = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return [h[key] for h in log if "loss" in h]


def _adapter(folder: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    return config, load_file(str(folder / "adapter_model.safetensors"))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _base(loader: str, folder: Path):
    if loader == "polyfuse":
        return PfAuto.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.set_attn_implementation("eager")
    return model


@torch.no_grad()
def _logits_and_greedy(model, ids: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids).logits
    tokens = model.generate(input_ids=ids[:1, :6], max_new_tokens=8, do_sample=False, pad_token_id=pad)
    return logits, tokens


@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", list(FSDP_FILES))
def test_lora_under_fsdp2_equals_one_process(tiny_model, single, tmp_path, state_dict_type):
    cfg = tmp_path / "fsdp2.json"
    cfg.write_text(json.dumps({"fsdp_version": 2, "state_dict_type": state_dict_type}))
    out = tmp_path / "fsdp"
    t0 = time.perf_counter()
    p = _run(torchrun_cmd(RUN_CLM, "--model_name_or_path", tiny_model, *CLM, "--per_device_train_batch_size", "1",
                          "--output_dir", out, "--fsdp", "full_shard auto_wrap", "--fsdp_config", cfg))  # fmt: skip
    print(f"LoRA, FSDP2 x2 ({state_dict_type}): {time.perf_counter() - t0:.1f} s")
    assert p.stdout.count("trainable params") == 1 and p.stdout.count("saved to") == 1  # rank 0 alone prints
    assert FSDP_FILES[state_dict_type] in os.listdir(out / "checkpoint-2")  # sharded by FSDP2, not DDP

    for key in ("loss", "grad_norm"):  # the norm too: AdamW's steps barely change with the gradient's scale
        got, ref = _logged(out, key), _logged(single, key)
        assert len(got) == len(ref) == STEPS
        worst = max(_rel(a, b) for a, b in zip(got, ref))
        print(f"{key} {got} vs {ref}: worst relative difference {worst:.2e}")
        assert worst <= LOSS_RTOL, (key, got, ref)

    files = set(os.listdir(out))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert not any(f.startswith(("model", "pytorch_model")) for f in files), files  # the adapter, not the base
    (config, tensors), (ref_config, ref_tensors) = _adapter(out), _adapter(single)
    for c in (config, ref_config):  # PEFT keeps target_modules as a set: its list order varies from run to run
        c["target_modules"] = sorted(c["target_modules"])
    assert config == ref_config and config["r"] == 4 and config["lora_dropout"] == 0
    assert config["target_modules"] == sorted(TARGETS.split(","))
    assert sorted(tensors) == sorted(ref_tensors) and len(tensors) == 2 * 5 * 2  # A and B, 5 modules, 2 layers
    worst = max((tensors[k] - ref_tensors[k]).abs().max().item() for k in ref_tensors)
    print(f"adapter: largest difference {worst:.2e}")
    for k, want in ref_tensors.items():
        assert tensors[k].shape == want.shape, k  # gathered whole, not a rank's shard
        torch.testing.assert_close(tensors[k], want, **ADAPTER_TOL, msg=k)
        if ".lora_B." in k:
            assert want.abs().max() > 1e-3, k  # PEFT starts lora_B at zero: it was trained

    base_config = transformers.AutoConfig.from_pretrained(str(tiny_model))
    ids = torch.randint(3, base_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    for loader in ("polyfuse", "transformers"):
        ours, theirs = (PeftModel.from_pretrained(_base(loader, tiny_model), str(d)).eval() for d in (out, single))
        logits, tokens = _logits_and_greedy(ours, ids, base_config.eos_token_id)
        want, want_tokens = _logits_and_greedy(theirs, ids, base_config.eos_token_id)
        torch.testing.assert_close(logits, want, **LOGITS_TOL, msg=loader)
        assert torch.equal(tokens, want_tokens), (loader, tokens, want_tokens)
        with torch.no_grad(), ours.disable_adapter():
            bare = ours(input_ids=ids).logits
        print(f"{loader}: logits within {(logits - want).abs().max().item():.2e}, "
              f"{(bare - want).abs().max().item():.2e} without the adapter")  # fmt: skip
        assert (bare - want).abs().max() > 1e-3, loader
