"""LoRA through PEFT on polyfuse's own models: transformers' projection names (q/k/v_proj, gate/up_proj as slices of
the fused qkv_proj / gate_up_proj) as PEFT target_modules, against transformers + PEFT on the same weights and the
same adapter (loss, every adapter gradient, logits), PEFT's adapter format both ways, merge_and_unload, the
projection dispatch (fused GEMM while no slice is wrapped; the fused ops stay in use), PolyfuseTrainer save/resume of
an adapter, and run_clm.py --lora_rank end to end on both --model_impl."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import assert_one_clm_error, load_run_clm, one_thread, perturb_, run_clm_main, tiny_config  # noqa: F401


peft = pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from polyfuse.models import AutoModelForCausalLM as PfAuto  # noqa: E402
from polyfuse.models.projection_slice import ProjectionSlice  # noqa: E402
from polyfuse.training import PolyfuseTrainer, PolyfuseTrainingArguments  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.05, rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {
    "llama": lambda: tiny_config(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),  # q/k/v biases: sliced with the weights
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=24),  # qk_norm: its own heads()
}
HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a transformers checkpoint folder with random weights (norms and biases moved off 1 and 0)."""
    built = {}

    def get(family: str) -> str:
        if family not in built:
            torch.manual_seed(0)
            hf = perturb_(HF_CLASSES[family](FAMILIES[family]()).float())
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            built[family] = str(path)
        return built[family]

    return get


def lora_config(targets=ALL, r=4, dropout=0.0):
    # init_lora_weights=False: lora_B random too, so the adapter changes the output from the start
    targets = targets if isinstance(targets, str) else list(targets)  # a string: PEFT's "all-linear"
    return LoraConfig(
        r=r, lora_alpha=8, lora_dropout=dropout, target_modules=targets, init_lora_weights=False, task_type="CAUSAL_LM"
    )


def hf_lora(folder, targets=ALL, seed=1):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    hf.set_attn_implementation("eager")
    torch.manual_seed(seed)
    return get_peft_model(hf, lora_config(targets))


def pf_lora(folder, targets=ALL, seed=1, training=True):
    base = PfAuto.from_pretrained(folder, training=training)
    torch.manual_seed(seed)
    return get_peft_model(base, lora_config(targets))


def adapter_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def copy_adapter(src, dst) -> None:
    """The same adapter weights in both (the names are the same on both models)."""
    theirs = adapter_params(dst)
    mine = adapter_params(src)
    assert mine.keys() == theirs.keys()
    with torch.no_grad():
        for n, p in mine.items():
            theirs[n].copy_(p)


def assert_grad_close(g, ref, name, tol=1e-5):
    """Gradients equal up to fp32 summation order: the largest difference within ``tol`` of the largest entry."""
    assert g is not None and ref is not None and ref.abs().max() > 0, name
    err, scale = (g - ref).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, f"{name}: max |diff| {err:.3g} > {tol} * max |grad| {scale:.3g}"


def assert_same_loss_and_adapter_grads(hf, pf, ids, tol: float) -> dict:
    """transformers + PEFT and polyfuse + PEFT on ``ids``: the same loss (1e-5 relative), then after backward the same
    adapter gradients (``tol`` of the largest entry); returns transformers' adapter parameters."""
    loss_hf, loss_pf = hf(input_ids=ids, labels=ids).loss, pf(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss_pf, loss_hf, rtol=1e-5, atol=0)
    loss_hf.backward()
    loss_pf.backward()
    want = adapter_params(hf)
    for n, p in adapter_params(pf).items():
        assert_grad_close(p.grad, want[n].grad, n, tol=tol)
    return want


def batch(vocab, rows=2, length=12, seed=3):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_adapter_gradients_match_transformers_peft(family, folders):
    folder = folders(family)
    hf, pf = hf_lora(folder), pf_lora(folder)
    ids = batch(hf.config.vocab_size)
    # PEFT wraps the same modules in the same order on both (polyfuse registers q, k, v, o / gate, up, down as
    # transformers does), so the same seed gives the same adapter; the names are identical one to one.
    hf_ad, pf_ad = adapter_params(hf), adapter_params(pf)
    assert hf_ad.keys() == pf_ad.keys() and len(pf_ad) == 2 * len(ALL) * COMMON["num_hidden_layers"]
    for n, p in hf_ad.items():
        assert torch.equal(pf_ad[n], p), n
    assert [n for n, p in pf.named_parameters() if p.requires_grad] == list(pf_ad)  # only the adapter trains

    loss_hf = hf(input_ids=ids, labels=ids).loss
    loss_pf = pf(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss_pf, loss_hf, rtol=1e-5, atol=0)
    with torch.no_grad(), pf.disable_adapter():  # the adapter matters: a dropped one would be seen above
        assert abs(pf(input_ids=ids, labels=ids).loss.item() - loss_pf.item()) > 1e-3
    loss_hf.backward()
    loss_pf.backward()
    for n, p in pf_ad.items():
        assert_grad_close(p.grad, hf_ad[n].grad, n)
    assert all(p.grad is None for n, p in pf.named_parameters() if "lora_" not in n)  # the base stays frozen


@pytest.mark.slow
def test_builtin_model_loss_and_gradients_match_transformers_peft():
    """The built-in SmolLM2-135M (its GGUF dequantized by polyfuse's loader, the same tensors copied into
    transformers' Llama of the same config), LoRA rank 4 on all seven projections of all 30 layers."""
    from polyfuse.loader.load import hf_state_items
    from polyfuse.models.builtin import builtin_model

    try:
        folder, gguf = builtin_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    pf = PfAuto.from_pretrained(folder, gguf_file=gguf, quant="none", training=True)
    hf = transformers.LlamaForCausalLM(pf.config).float()
    missing, unexpected = hf.load_state_dict(dict(hf_state_items(pf)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.set_attn_implementation("eager")
    torch.manual_seed(1)
    hf = get_peft_model(hf, lora_config())
    torch.manual_seed(1)
    pf = get_peft_model(pf, lora_config())
    assert adapter_params(hf).keys() == adapter_params(pf).keys()
    copy_adapter(hf, pf)
    want = assert_same_loss_and_adapter_grads(hf, pf, batch(pf.config.vocab_size, rows=1, length=16), tol=1e-4)
    assert len(want) == 2 * 7 * pf.config.num_hidden_layers


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ALL], ids=["q_v", "all"])
def test_dropout_masks_match_transformers_peft(folders, targets):
    """LoRA dropout 0.3: polyfuse's lora_linear draws its masks with native_dropout (what F.dropout runs) in PEFT's
    module order (q, k, v, o, gate, up, down), so from the same seed both models drop the same elements: the same
    loss and adapter gradients. Against a run without dropout the loss differs (the masks matter)."""
    folder = folders("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    hf.set_attn_implementation("eager")
    torch.manual_seed(1)
    hf = get_peft_model(hf, lora_config(targets, dropout=0.3))
    torch.manual_seed(1)
    pf = get_peft_model(PfAuto.from_pretrained(folder, training=True), lora_config(targets, dropout=0.3))
    copy_adapter(hf, pf)
    hf.train(), pf.train()
    ids = batch(hf.config.vocab_size)
    torch.manual_seed(7)
    loss_hf = hf(input_ids=ids, labels=ids).loss
    torch.manual_seed(7)
    loss_pf = pf(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss_pf, loss_hf, rtol=1e-5, atol=0)
    with torch.no_grad():
        pf.eval()
        assert abs(pf(input_ids=ids, labels=ids).loss.item() - loss_pf.item()) > 1e-4
    loss_hf.backward()
    loss_pf.backward()
    want = adapter_params(hf)
    for n, p in adapter_params(pf).items():
        assert_grad_close(p.grad, want[n].grad, n)


class _Proj(torch.nn.Module):
    def __init__(self, k, n, dtype):
        super().__init__()
        self.proj = torch.nn.Linear(k, n, bias=True, dtype=dtype)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_op_against_peft_module(dtype, device):
    """The op on one PEFT layer (a bf16 base keeps PEFT's default fp32 adapter: x is cast up, the sum cast back):
    the same output and gradients for x and both adapter weights as the module's own forward, with dropout 0.25 from
    the same seed; and less saved for the backward (x once, a bool mask), measured with saved_tensors_hooks."""
    from polyfuse.models.peft_lora import plain_lora
    from polyfuse.ops.lora_linear import lora_linear_native

    torch.manual_seed(0)
    model = get_peft_model(
        _Proj(64, 48, dtype),
        LoraConfig(r=8, lora_alpha=16, lora_dropout=0.25, target_modules=["proj"], init_lora_weights=False),
    )
    model.to(device)
    layer = model.base_model.model.proj
    layer.train()
    assert layer.lora_A["default"].weight.dtype == torch.float32
    x0 = torch.randn(3, 5, 64).to(dtype).to(device)
    lora = plain_lora(layer, x0)
    assert lora is not None and lora[1].dropout == 0.25 and lora[1].scaling == 2.0

    def run(fn):
        x = x0.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            torch.manual_seed(5)
            out = fn(x)
        out.backward(torch.linspace(-1, 1, out.numel(), device=device).reshape(out.shape).to(dtype))
        grads = [x.grad] + [p.grad.clone() for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)]
        layer.zero_grad()
        return out, grads, sum(saved)

    out_ref, grads_ref, saved_ref = run(layer)
    out, grads, saved = run(lambda x: lora_linear_native(x, lora[0].weight, lora[0].bias, (lora[1],)))
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, out_ref, rtol=tol, atol=tol)
    for g, ref, name in zip(grads, grads_ref, ("x", "lora_A", "lora_B")):
        assert_grad_close(g, ref, name, tol=1e-5 if dtype == torch.float32 else 1e-2)
    if dtype == torch.bfloat16:  # PEFT keeps the fp32 copy of x that dropout returns (4 bytes per element), here x
        assert saved <= saved_ref - 2 * x0.numel()
    else:  # fp32: PEFT's CUDA dropout keeps a bool mask and its fp32 output, as much as x and the mask here
        assert saved <= saved_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lowrank_add_matches_native(dtype):
    """backends/triton/lora_linear.py's fused y += (h @ w) * mask * scale (the CPU interpreter without a GPU)
    against the native add: with a dropout mask and scale (the backward's input gradient), with a block-diagonal w
    given transposed (the forward), ranks not a power of two, T and N not multiples of the tiles."""
    pytest.importorskip("triton")
    from polyfuse.backends.triton.lora_linear import add_lowrank
    from polyfuse.ops.lora_linear import add_lowrank_native

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    y0 = torch.randn(70, 200, generator=gen).to(dtype).to(device)
    h = torch.randn(70, 24, generator=gen).to(device)
    mask = (torch.rand(70, 200, generator=gen) > 0.3).to(device)
    cases = [(torch.randn(24, 200, generator=gen).to(device), mask, 1 / 0.7),
             (torch.randn(200, 24, generator=gen).to(device).t(), None, 1.0)]  # fmt: skip
    cases.append((torch.randn(24, 90, generator=gen).to(device), None, 1.0))  # a column view of y: one fused part
    for w, m, scale in cases:
        want, got = y0.clone(), y0.clone()
        cols = slice(0, 200) if w.shape[1] == 200 else slice(70, 160)
        add_lowrank_native(want[:, cols], h, w, m, scale)
        add_lowrank(got[:, cols], h, w, m, scale)
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert (got[:, cols] != y0[:, cols]).float().mean() > 0.5
        untouched = torch.ones(200, dtype=torch.bool)
        untouched[cols] = False
        assert torch.equal(got[:, untouched], y0[:, untouched])  # a column view's neighbours are not written


def _triton_training_impls() -> list:
    from polyfuse.core.registry import implementations, ops

    return [
        impl for op in ops() for impl in implementations(op)
        if impl.backend in ("cuda", "triton") and impl.supports_backward and "triton" in impl.name.lower()
        and impl.op != "attention"  # compared per op in the backend's tests; too slow interpreted here
    ]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels through the CPU interpreter")
def test_lora_on_the_triton_training_kernels_interpreted(folders):
    """The GPU's training kernels (RMSNorm, add + RMSNorm, rotary, which rotates q and k in place, SwiGLU, the fused
    linear cross-entropy; forward and backward) under LoRA on all seven projections, run on the CPU through
    TRITON_INTERPRET=1: the same loss and adapter gradients as transformers + PEFT."""
    impls = _triton_training_impls()
    if not impls:
        pytest.skip("no Triton training kernels registered")
    folder = folders("llama")
    hf, pf = hf_lora(folder), pf_lora(folder)
    kernels = pf.get_base_model().kernels
    for impl in impls:
        setattr(kernels, impl.op, impl.fn)
    assert {"rotary", "swiglu", "linear_cross_entropy"} <= {impl.op for impl in impls}
    assert_same_loss_and_adapter_grads(hf, pf, batch(hf.config.vocab_size, rows=1, length=8), tol=1e-4)


class CountingKernels:
    """The model's Kernels, recording each op call and the shapes of its tensor arguments."""

    def __init__(self, kernels):
        self._kernels, self.calls = kernels, []

    def __getattr__(self, name):
        fn = getattr(self._kernels, name)

        def call(*args, **kw):
            self.calls.append((name, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return fn(*args, **kw)

        return call if callable(fn) else fn

    def ops(self):
        return {name for name, _ in self.calls}

    def weights(self, op):
        return {shapes[1] for name, shapes in self.calls if name == op}


@pytest.mark.parametrize(
    "targets, qkv_op, gate_up_op, down_op",
    [
        ([], "linear", "linear", "swiglu_linear"),
        (["o_proj", "down_proj"], "linear", "linear", "lora_linear"),
        (["q_proj", "v_proj"], "lora_linear", "linear", "swiglu_linear"),  # run_clm's default
        (["gate_proj"], "linear", "lora_linear", "swiglu_linear"),
        (ALL, "lora_linear", "lora_linear", "lora_linear"),
    ],
)
def test_dispatch_fused_gemm_with_or_without_adapters(folders, targets, qkv_op, gate_up_op, down_op):
    """qkv_proj / gate_up_proj run as one GEMM whether or not PEFT wrapped some of their slices: bare, through the
    linear op; with plain LoRA on any part, through lora_linear with the fused weight and one adapter per wrapped part.
    A wrapped o_proj / down_proj goes to lora_linear with its own weight; RMSNorm, rotary, attention, SwiGLU and the
    fused cross-entropy stay ops."""
    pf = PfAuto.from_pretrained(folders("llama"), training=True)
    model = get_peft_model(pf, lora_config(targets)) if targets else pf
    counting = pf.kernels = CountingKernels(pf.kernels)
    ids = batch(pf.config.vocab_size)
    model(input_ids=ids, labels=ids).loss.backward()
    a, h, inter = pf.model.layers[0].self_attn, COMMON["hidden_size"], COMMON["intermediate_size"]
    qkv = (a.q_size + 2 * a.kv_size, h)
    assert {"rms_norm", "add_rms_norm", "rotary", "attention", "linear_cross_entropy"} <= counting.ops()
    assert qkv in counting.weights(qkv_op) and (2 * inter, h) in counting.weights(gate_up_op)
    parts = {(a.kv_size, h), (inter, h)}  # no part projected on its own ((q_size, h) is o_proj's shape here)
    assert not parts & (counting.weights("linear") | counting.weights("lora_linear"))
    if down_op == "lora_linear":
        assert (h, inter) in counting.weights("lora_linear")
        assert "swiglu" in counting.ops() and "swiglu_linear" not in counting.ops()
    else:
        assert "swiglu_linear" in counting.ops()
    per_layer = [qkv_op == "lora_linear", gate_up_op == "lora_linear", "o_proj" in targets, down_op == "lora_linear"]
    calls = [c for c in counting.calls if c[0] == "lora_linear"]
    assert len(calls) == sum(per_layer) * pf.config.num_hidden_layers


def test_lora_layer_in_another_state_runs_as_a_module(folders):
    """A PEFT layer the op does not cover (here: a forward hook on q_proj's LoRA layer) is called as a module, so
    its hook runs and q/k/v are projected one by one (k through the linear op on its bare slice)."""
    pf = PfAuto.from_pretrained(folders("llama"), training=True)
    model = get_peft_model(pf, lora_config(["q_proj", "v_proj"]))
    seen = []
    pf.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    counting = pf.kernels = CountingKernels(pf.kernels)
    ids = batch(pf.config.vocab_size)
    model(input_ids=ids, labels=ids).loss.backward()
    a, h = pf.model.layers[0].self_attn, COMMON["hidden_size"]
    assert len(seen) == 1 and (a.kv_size, h) in counting.weights("linear")
    assert (a.q_size + 2 * a.kv_size, h) in counting.weights("lora_linear")  # the other layers


def test_fused_projection_and_its_slices_both_adapted_is_refused(folders):
    """PEFT's target_modules='all-linear' takes every nn.Linear: qkv_proj and q/k/v_proj alike. The slices then run
    one by one and qkv_proj's own adapter would never run: refused, not dropped. The fused module alone works."""
    pf = PfAuto.from_pretrained(folders("llama"), training=True)
    model = get_peft_model(pf, lora_config("all-linear"))
    assert type(pf.model.layers[0].self_attn.q_proj) is not ProjectionSlice
    ids = batch(pf.config.vocab_size)
    with pytest.raises(ValueError, match="qkv_proj is wrapped .* adapt either qkv_proj or transformers' names"):
        model(input_ids=ids)
    fused = pf_lora(folders("llama"), targets=["qkv_proj"])  # one adapter on [q; k; v]: the fused GEMM is called
    with torch.no_grad(), fused.disable_adapter():
        bare = fused(input_ids=ids).logits
    assert (fused(input_ids=ids).logits - bare).abs().max() > 1e-3


def test_slices_add_no_parameters_and_follow_the_fused_weight(folders):
    pf = PfAuto.from_pretrained(folders("qwen2"), training=True)
    names = [n for n, _ in pf.named_parameters()]
    assert not any(p in n for n in names for p in (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj"))
    assert not any(".q_proj" in k or ".gate_proj" in k for k in pf.state_dict())
    attn, mlp = pf.model.layers[1].self_attn, pf.model.layers[1].mlp
    assert isinstance(attn.k_proj, torch.nn.Linear) and isinstance(mlp.up_proj, ProjectionSlice)
    assert list(attn.k_proj.parameters()) == [] and attn.k_proj.state_dict() == {}
    q, kv = attn.q_size, attn.kv_size
    assert torch.equal(attn.k_proj.weight, attn.qkv_proj.weight[q : q + kv])
    assert torch.equal(attn.v_proj.bias, attn.qkv_proj.bias[q + kv :])  # qwen2's q/k/v biases
    assert torch.equal(mlp.up_proj.weight, mlp.gate_up_proj.weight[mlp.inter :])
    # load_state_dict and .to() replace or convert the fused tensors: the slices read the current ones
    sd = {k: torch.randn_like(v) for k, v in pf.state_dict().items()}
    pf.load_state_dict(sd)
    assert torch.equal(attn.k_proj.weight, sd["model.layers.1.self_attn.qkv_proj.weight"][q : q + kv])
    pf.to(torch.float64)
    assert attn.q_proj.weight.dtype == torch.float64
    assert attn.q_proj.weight.data_ptr() == attn.qkv_proj.weight.data_ptr()  # a view, no copy
    copied = copy.deepcopy(pf).model.layers[1].self_attn  # the copy's slices read the copy's fused weight
    assert copied.q_proj.weight.data_ptr() == copied.qkv_proj.weight.data_ptr() != attn.qkv_proj.weight.data_ptr()


def test_quantization_ignores_the_slices(folders):
    from polyfuse.quant import qlinear, quantize

    pf = PfAuto.from_pretrained(folders("llama"))
    candidates = [n for n, _ in quantize._candidates(pf)]
    assert candidates and all(n.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") for n in
                              candidates)  # fmt: skip
    quantize.quantize_model_(pf, "int8")
    assert set(qlinear.quantized_modules(pf)) == set(candidates)
    ids = batch(pf.config.vocab_size)
    assert torch.isfinite(pf(ids).logits).all()


@pytest.mark.parametrize("direction", ["polyfuse_to_transformers", "transformers_to_polyfuse"])
def test_adapter_saved_by_one_loads_into_the_other(folders, tmp_path, direction):
    folder = folders("llama")
    src = pf_lora(folder) if direction == "polyfuse_to_transformers" else hf_lora(folder)
    src.save_pretrained(tmp_path / "adapter")
    files = set(os.listdir(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == folder
    if direction == "polyfuse_to_transformers":
        base = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
        base.set_attn_implementation("eager")
    else:
        base = PfAuto.from_pretrained(folder)
    dst = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    src.eval()
    ids = batch(src.config.vocab_size)
    with torch.no_grad():
        want, got = src(input_ids=ids).logits, dst(input_ids=ids).logits
        with dst.disable_adapter():
            bare = dst(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    assert (bare - want).abs().max() > 1e-3  # the adapter was loaded, not dropped


@pytest.mark.parametrize("safe", [False, True])  # safe_merge: PEFT assigns weight.data (projection_slice.py)
def test_merge_and_unload_gives_the_unmerged_logits(folders, tmp_path, safe):
    folder = folders("qwen3")
    pf = pf_lora(folder).eval()
    ids = batch(pf.config.vocab_size)
    with torch.no_grad():
        unmerged = pf(input_ids=ids).logits
        gen = pf.generate(input_ids=ids[:1, :6], max_new_tokens=6)  # polyfuse's engine, adapters as modules
    before = PfAuto.from_pretrained(folder).model.layers[0].self_attn.qkv_proj.weight
    merged = pf.merge_and_unload(safe_merge=safe)
    attn = merged.model.layers[0].self_attn
    assert type(attn.q_proj) is ProjectionSlice and type(merged.model.layers[0].mlp.gate_proj) is ProjectionSlice
    assert (attn.qkv_proj.weight - before).abs().max() > 1e-3  # the deltas landed in the fused weight
    with torch.no_grad():
        got = merged(input_ids=ids).logits
        assert torch.equal(merged.generate(input_ids=ids[:1, :6], max_new_tokens=6), gen)
    torch.testing.assert_close(got, unmerged, rtol=1e-5, atol=2e-5)
    # the merged model saves as a plain transformers checkpoint with the merged weights
    merged.save_pretrained(tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, unmerged, rtol=1e-4, atol=1e-4)


def _args(tmp, **kw):
    base = dict(
        output_dir=str(tmp), per_device_train_batch_size=2, learning_rate=1e-2, max_steps=6, save_steps=3,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    base.update(kw)
    return PolyfuseTrainingArguments(**base)


def _dataset(vocab, n=12, length=12):
    ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def test_trainer_saves_the_adapter_and_resumes_it(folders, tmp_path):
    """PolyfuseTrainer on a PeftModel of polyfuse's Llama: kernels resolved for training on the base model, the
    checkpoints are PEFT's adapter (no full weights), and a resume into an adapter initialized differently ends where
    the uninterrupted run ends."""
    folder = folders("llama")
    model = pf_lora(folder, seed=1, training=False)
    assert not model.get_base_model().kernels.context.training
    full = PolyfuseTrainer(model, _args(tmp_path / "a"), train_dataset=_dataset(96))
    base = full.model.get_base_model()
    assert full.polyfuse_kernels is base.kernels and base.kernels.context.training  # re-resolved for training
    assert full.model_accepts_loss_kwargs is False  # polyfuse's forward ignores num_items_in_batch
    full.train()
    ckpt = tmp_path / "a" / "checkpoint-3"
    files = set(os.listdir(ckpt))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in files)
    resumed = PolyfuseTrainer(pf_lora(folder, seed=2), _args(tmp_path / "b"), train_dataset=_dataset(96))
    start = {n: p.detach().clone() for n, p in adapter_params(resumed.model).items()}
    resumed.train(resume_from_checkpoint=str(ckpt))
    got, want = adapter_params(resumed.model), adapter_params(full.model)
    assert got.keys() == want.keys() == start.keys()
    for n, p in want.items():
        assert not torch.allclose(start[n], p)  # a different start: the resume really loaded the adapter
        torch.testing.assert_close(got[n], p, atol=1e-6, rtol=1e-5, msg=n)
    loss = {h["step"]: h["loss"] for h in full.state.log_history if "loss" in h}
    loss_r = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    assert {4, 5, 6} <= set(loss_r)
    for s in (4, 5, 6):
        assert loss_r[s] == pytest.approx(loss[s], rel=1e-5)


def test_gradient_checkpointing_under_lora(folders):
    """Trainer (transformers 5) enables checkpointing through activation_checkpointing_enable on the PeftModel;
    the gradients of the adapter are unchanged by it."""
    folder = folders("llama")
    ids = batch(96)
    grads = []
    for ckpt in (False, True):
        model = pf_lora(folder).train()
        base = model.get_base_model()
        if ckpt:  # what transformers 5's Trainer calls (through the PeftModel)
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=None, every_n_layers=1, offload=False
            )
            assert base.is_gradient_checkpointing
        calls = []
        base.model.layers[0].self_attn.register_forward_pre_hook(lambda *a: calls.append(1))
        model(input_ids=ids, labels=ids).loss.backward()
        assert len(calls) == (2 if ckpt else 1)  # checkpointed: the block runs again in the backward
        grads.append({n: p.grad for n, p in adapter_params(model).items()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-6, atol=1e-7, msg=n)
    with pytest.raises(ValueError, match="every layer"):
        base.gradient_checkpointing_enable(every_n_layers=2)


# ---- run_clm.py --lora_rank -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_clm():
    module = load_run_clm("run_clm_lora_under_test")
    yield module
    sys.modules.pop("run_clm_lora_under_test", None)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from test_training import _tiny_model_folder

    return _tiny_model_folder(tmp_path_factory.mktemp("clm_tiny"))


def _clm(run_clm, capsys, *argv):
    return run_clm_main(run_clm, capsys, *argv)


def _one_error(rc, out, err, needle):
    assert_one_clm_error(rc, out, err, needle)


@pytest.mark.parametrize("impl", ["transformers", "polyfuse"])
def test_run_clm_lora_end_to_end(run_clm, capsys, tiny_model, tmp_path, impl):
    out = tmp_path / "out"
    rc, stdout, err = _clm(
        run_clm, capsys, "--model_name_or_path", tiny_model, "--output_dir", out, "--max_steps", "3",
        "--block_size", "32", "--per_device_train_batch_size", "2", "--logging_steps", "1", "--report_to", "none",
        "--use_cpu", "--learning_rate", "1e-2", "--save_steps", "2", "--model_impl", impl,
        "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0.1", "--lora_target_modules", "q_proj,up_proj",
        "--gradient_checkpointing", "True",  # transformers 5's Trainer: activation_checkpointing_enable(...)
    )  # fmt: skip
    assert rc == 0, err[-3000:]
    assert "trainable params" in stdout and "polyfuse backends" in stdout and "saved to" in stdout
    for folder in (out, out / "checkpoint-2"):
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["lora_dropout"] == 0.1
        assert sorted(cfg["target_modules"]) == ["q_proj", "up_proj"] and cfg["task_type"] == "CAUSAL_LM"
        assert (folder / "adapter_model.safetensors").is_file() and not (folder / "model.safetensors").exists()
    # the adapter loads onto the other implementation's base model; PEFT starts lora_B at zero, a trained one is not
    if impl == "transformers":
        base = PfAuto.from_pretrained(str(tiny_model))
    else:
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).float()
    model = PeftModel.from_pretrained(base, out)
    b = adapter_params(model)
    assert b and all(p.abs().max() > 0 for n, p in b.items() if "lora_B" in n)
    assert any(".q_proj." in n for n in b) and any(".up_proj." in n for n in b) and not any(".v_proj." in n for n in b)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lora_rank", "-1"], "--lora_rank must be >= 0"),
        (["--lora_rank", "4", "--lora_target_modules", "q_proj,qkv_proj"], "unknown module 'qkv_proj'"),
        (["--lora_rank", "4", "--lora_target_modules", " , "], "unknown module list (empty)"),
        (["--lora_rank", "4", "--lora_dropout", "1.5"], "--lora_dropout must be in [0, 1)"),
    ],
)
def test_run_clm_lora_bad_input_one_line(run_clm, capsys, tmp_path, args, message):
    _one_error(*_clm(run_clm, capsys, "--output_dir", tmp_path, "--model_impl", "polyfuse", *args), message)


@pytest.mark.slow
def test_run_clm_lora_without_peft_one_line(run_clm, capsys, tmp_path, monkeypatch):
    # in the process: peft not importable
    monkeypatch.setitem(sys.modules, "peft", None)
    _one_error(*_clm(run_clm, capsys, "--output_dir", tmp_path, "--lora_rank", "4"), "--lora_rank needs peft")
    # a fresh interpreter where transformers does not see peft either: run_clm still imports and says the same
    script = str(ROOT / "examples" / "run_clm.py")
    code = "import runpy, sys; sys.modules['peft'] = None; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-c", code, script, "--output_dir", str(tmp_path), "--lora_rank", "4"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    _one_error(r.returncode, r.stdout, r.stderr, "--lora_rank needs peft")
