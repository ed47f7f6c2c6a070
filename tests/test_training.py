"""Training: convergence with/without fused ops (and with the Triton kernels through the interpreter), Trainer
save/resume, argument validation, and run_clm.py end to end."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama

from polyfuse.core.registry import SelectionContext, implementations, ops, resolve
from polyfuse.patch import patch
from polyfuse.training import PolyfuseTrainer, PolyfuseTrainingArguments


ROOT = Path(__file__).resolve().parents[1]
STEPS = 32
# Liger-Kernel's fp32 convergence tolerances (mini_llama3, 32 steps): loss (1e-8, 2e-5), params (5e-3, 1e-5).
# Ours are tighter on params because our native ops are bit-for-bit transformers' math.
LOSS_TOL = {"atol": 1e-6, "rtol": 2e-5}
PARAM_TOL = {"atol": 1e-4, "rtol": 1e-5}


def train_curve(kernels=None, steps=STEPS, lr=1e-3, batch=4, seq=32):
    model = tiny_llama(seed=0)
    if kernels is not None:
        patch(model, kernels=kernels)
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (4, batch, seq), generator=g)  # 4 batches seen again and again: learnable
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        ids = data[step % len(data)]
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return train_curve(None)


def assert_converges_like(curve, ref):
    losses, params = curve
    ref_losses, ref_params = ref
    torch.testing.assert_close(losses, ref_losses, **LOSS_TOL)
    for n, p in params.items():
        torch.testing.assert_close(p, ref_params[n], **PARAM_TOL, msg=n)


def training_kernels(overrides="attention=native"):
    return resolve(SelectionContext(torch.device("cpu"), torch.float32, training=True, overrides=overrides))


def test_convergence_registry_kernels(reference):
    losses, _ = reference
    assert losses[-1] < losses[0] - 0.05, "the reference run must actually learn"
    assert_converges_like(train_curve(training_kernels()), reference)


def test_convergence_detects_a_small_error(reference):
    """Negative control: a SwiGLU off by 0.1% must fail the same tolerances (the comparison can fail)."""
    k = training_kernels()
    good = k.swiglu
    k.swiglu = lambda gate, up: good(gate, up) * 1.001
    with pytest.raises(AssertionError):
        assert_converges_like(train_curve(k), reference)


def _triton_impls():
    out = []
    for op in ops():
        for impl in implementations(op):
            if impl.backend in ("cuda", "triton") and impl.supports_backward and "triton" in impl.name.lower():
                out.append(impl)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not _triton_impls(), reason="no Triton training kernels registered")
def test_convergence_triton_kernels_interpreted(reference):
    """The CUDA backend's Triton kernels (forward + backward) run on CPU through TRITON_INTERPRET=1: a Kernels object
    whose functions are those kernels, bypassing the device probe that would keep them off a CPU run."""
    k = training_kernels()
    used = []
    for impl in _triton_impls():
        if impl.op == "attention":
            continue  # attention is compared per op in the backend's own tests; 32 interpreted steps are too slow
        setattr(k, impl.op, impl.fn)
        used.append(f"{impl.op}:{impl.name}")
    if not used:
        pytest.skip("only attention has a Triton training kernel")
    # The interpreter runs one program instance at a time: a smaller batch keeps 32 steps affordable.
    small = {"batch": 1, "seq": 8, "steps": STEPS}  # ~3 s per interpreted step
    assert_converges_like(train_curve(k, **small), train_curve(None, **small))


# ------------------------------------------------------------------------------------------------ Trainer


def _args(tmp, **kw):
    base = {
        "output_dir": str(tmp),
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-3,
        "max_steps": 6,
        "save_steps": 3,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    base.update(kw)
    return PolyfuseTrainingArguments(**base)


def _dataset(n=16, length=16):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (n, length), generator=g)
    # Position 0 is never a target after the shift; masking it makes transformers 4.x's num_items_in_batch (counted
    # over the unshifted labels) equal 5.x's (counted over labels[..., 1:]), so both scale the loss alike.
    return [{"input_ids": r, "labels": torch.cat([torch.tensor([-100]), r[1:]])} for r in ids]


def test_trainer_save_resume_matches_uninterrupted(tmp_path, capsys):
    full = PolyfuseTrainer(tiny_llama(), _args(tmp_path / "a"), train_dataset=_dataset())
    full.train()
    out = capsys.readouterr().out
    assert out.count("polyfuse backends") == 1  # kernels report printed once at train start
    logs = [h for h in full.state.log_history if "loss" in h]
    assert all("train_tokens_per_second" in h and h["train_tokens_per_second"] > 0 for h in logs)
    assert "max_memory_allocated (GB)" in logs[0]

    resumed = PolyfuseTrainer(tiny_llama(), _args(tmp_path / "b"), train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    got = dict(resumed.model.named_parameters())
    for n, p in full.model.named_parameters():
        torch.testing.assert_close(got[n], p, atol=1e-6, rtol=1e-6, msg=n)
    loss = {h["step"]: h["loss"] for h in full.state.log_history if "loss" in h}
    loss_r = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    missing = {4, 5, 6} - set(loss_r)
    assert not missing, f"resumed run logged no loss for steps {sorted(missing)}: {resumed.state.log_history}"
    for s in (4, 5, 6):
        assert loss_r[s] == pytest.approx(loss[s], rel=1e-5)


def test_fused_flags_map_to_overrides(tmp_path):
    a = _args(tmp_path, use_fused_rope=False, use_fused_rms_norm=False, polyfuse_ops="attention=native")
    assert a.polyfuse_overrides() == "-rms_norm,-add_rms_norm,-rotary,attention=native"
    t = PolyfuseTrainer(tiny_llama(), a, train_dataset=_dataset(4))
    choices = t.polyfuse_kernels.choices
    assert "forced native" in choices["rotary"].reason and t.polyfuse_kernels.context.training
    assert t.model.config._attn_implementation == "polyfuse"


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"use_lazy_mode": True}, "--use_lazy_mode can only be used with --use_habana"),
        ({"gaudi_config_name": "gaudi_config.json"}, "--gaudi_config_name can only be used with --use_habana"),
        ({"use_habana": True}, "--use_habana needs an Intel Gaudi"),
        ({"polyfuse_ops": "+rms_nrom"}, "unknown op 'rms_nrom'"),
        ({"polyfuse_ops": "rms_norm"}, "bad op override"),
        ({"flash_attention_recompute": True}, "need --use_flash_attention"),
    ],
)
def test_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match) as e:
        _args(tmp_path, **kw)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------ run_clm.py


def _tiny_model_folder(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(ROOT / "examples" / "data" / "tiny_corpus.txt")], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(fast),
        max_position_embeddings=128,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def _run_clm(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "examples" / "run_clm.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_run_clm_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM

    src = _tiny_model_folder(tmp_path / "tiny")
    out = tmp_path / "out"
    r = _run_clm(
        "--model_name_or_path", str(src), "--output_dir", str(out), "--max_steps", "3", "--block_size", "32",
        "--per_device_train_batch_size", "2", "--logging_steps", "1", "--report_to", "none", "--use_cpu",
        "--learning_rate", "1e-3", "--save_strategy", "no",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "polyfuse backends" in r.stdout
    loaded = AutoModelForCausalLM.from_pretrained(out)
    before = AutoModelForCausalLM.from_pretrained(src)
    ids = torch.arange(10)[None]
    logits = loaded(ids).logits
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits, before(ids).logits)  # it trained and saved the trained weights


@pytest.mark.slow
def test_run_clm_bad_arguments_one_line(tmp_path):
    # a __post_init__ ValueError and an argparse error (unknown op overrides are covered by test_bad_arguments)
    for bad in (["--use_lazy_mode", "True"], ["--no_such_flag", "1"]):
        r = _run_clm("--output_dir", str(tmp_path), *bad)
        assert r.returncode == 2, (bad, r.stderr)
        err = r.stderr.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("run_clm.py: error:"), err


def test_trainer_trains_polyfuse_llama_like_transformers(tmp_path):
    """PolyfuseTrainer on polyfuse's own Llama (kernels re-resolved for training, loss through the fused linear
    cross-entropy) follows transformers' Trainer on transformers' Llama from the same weights."""
    import transformers

    from polyfuse.loader.load import hf_state_items
    from polyfuse.models.llama import LlamaForCausalLM as PfLlama

    hf = tiny_llama(seed=5)
    hf.save_pretrained(tmp_path / "init")
    ours = PfLlama.from_pretrained(str(tmp_path / "init"))
    ref = transformers.Trainer(hf, _args(tmp_path / "hf", save_steps=100), train_dataset=_dataset())
    ref.train()
    trainer = PolyfuseTrainer(ours, _args(tmp_path / "pf", save_steps=100), train_dataset=_dataset())
    trainer.train()
    assert trainer.model.kernels.context.training, "kernels were not re-resolved in training mode"
    loss_hf = [h["loss"] for h in ref.state.log_history if "loss" in h]
    loss_pf = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(loss_pf) == len(loss_hf) == 6
    assert loss_pf == pytest.approx(loss_hf, rel=1e-4)
    assert loss_pf[-1] < loss_pf[0], "the loss did not go down"
    got = dict(hf_state_items(trainer.model))
    for name, p in hf.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-4, rtol=1e-4, msg=name)


def test_gradient_checkpointing_gives_the_same_gradients():
    """polyfuse's Llama supports transformers' gradient_checkpointing API with identical loss and gradients, and a
    checkpointed block keeps one [B, L, H] tensor (its input), not the (pending, residual) pair (issue 13: the pair
    doubled the checkpoints' memory against transformers + Liger)."""
    from polyfuse.models.llama import LlamaForCausalLM as PfLlama

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 24))
    grads, saved_hidden = [], []
    for ckpt in (False, True):
        model = PfLlama.from_config(tiny_llama().config, seed=7, training=True)
        if ckpt:
            model.gradient_checkpointing_enable()
        model.train()
        calls, hidden_shaped = [], []
        for layer in model.model.layers:
            layer.self_attn.register_forward_pre_hook(lambda *a: calls.append(1))

        def pack(t, shape=(2, 24, model.config.hidden_size)):
            if tuple(t.shape) == shape:
                hidden_shaped.append(t.data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids).loss
        loss.backward()
        n_layers = len(model.model.layers)
        # With checkpointing every block runs again in the backward.
        assert len(calls) == (2 * n_layers if ckpt else n_layers)
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        saved_hidden.append(len(set(hidden_shaped)))
    # Outside the checkpoints only each block's input stays (+ the final norm's input and output).
    assert saved_hidden[1] <= n_layers + 2, saved_hidden
    assert saved_hidden[1] < saved_hidden[0]
    assert torch.equal(grads[0][0], grads[1][0])
    assert grads[0][1].keys() == grads[1][1].keys()
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_trainer_save_resume_polyfuse_llama_matches_uninterrupted(tmp_path):
    """A polyfuse model's checkpoint-3 (a transformers checkpoint: q/k/v and gate/up split, tied lm_head left out)
    resumes into a model built from *other* weights and ends where the uninterrupted run ends: the weights are
    really read back (Trainer's own loader would match none of the names and load nothing)."""
    from polyfuse.loader.load import hf_state_items
    from polyfuse.models.llama import LlamaForCausalLM as PfLlama

    cfg = tiny_llama().config
    cfg.tie_word_embeddings = True
    full = PolyfuseTrainer(
        PfLlama.from_config(cfg, seed=1, training=True), _args(tmp_path / "a"), train_dataset=_dataset()
    )
    full.train()
    assert (tmp_path / "a" / "checkpoint-3" / "config.json").is_file()
    resumed = PolyfuseTrainer(
        PfLlama.from_config(cfg, seed=2, training=True), _args(tmp_path / "b"), train_dataset=_dataset()
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight  # still tied
    got = dict(hf_state_items(resumed.model))
    for n, p in hf_state_items(full.model):
        torch.testing.assert_close(got[n], p, atol=1e-6, rtol=1e-6, msg=n)
    loss = {h["step"]: h["loss"] for h in full.state.log_history if "loss" in h}
    loss_r = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    assert {4, 5, 6} <= set(loss_r), resumed.state.log_history
    for s in (4, 5, 6):
        assert loss_r[s] == pytest.approx(loss[s], rel=1e-5)


def test_cpu_fsdp_refused_with_old_accelerate(monkeypatch):
    """FSDP2 on a CPU-only run is tested with accelerate >= 1.15; older ones (optimum-habana's 1.10.1 pin) fail
    inside accelerate on a CPU, so the arguments refuse them with one line naming the versions."""
    import accelerate

    from polyfuse.training.arguments import cpu_fsdp_unsupported

    monkeypatch.setattr(accelerate, "__version__", "1.10.1")
    why = cpu_fsdp_unsupported()
    assert why is not None and "accelerate >= 1.15" in why and "1.10.1" in why
    monkeypatch.setattr(accelerate, "__version__", "1.15.0")
    assert cpu_fsdp_unsupported() is None
