"""Mistral, Qwen2 and Qwen3 on the same ops as Llama, each against transformers on the same random weights: fp32
logits, greedy batched generation with left padding, sliding windows (Mistral on every layer, Qwen past
``max_window_layers``), save/load both ways, GGUF (qwen2 / qwen3), ``polyfuse.patch`` on transformers' own models,
the family picked from the checkpoint, and the attention kernels' sliding window against transformers' mask rule."""

import copy
import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from helpers import (  # noqa: F401  (one_thread: autouse fixture)
    BOS,
    EOS,
    PAD,
    add_gguf_shape,
    left_padded,
    logits_diff,
    one_thread,
    perturb_,
    random_rows,
)
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    padding_mask_function,
    sliding_window_causal_mask_function,
)

import polyfuse
from polyfuse.compat import DTYPE_KW, rope_parameters
from polyfuse.core.errors import CheckpointError
from polyfuse.core.registry import SelectionContext, bound, resolve
from polyfuse.models import FAMILIES as POLYFUSE_FAMILIES
from polyfuse.models import AutoModelForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from polyfuse.ops.attention import AttentionMeta, attention_native, cache_mask


ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-4  # fp32 logits, polyfuse vs transformers
VOCAB = 96
WINDOW = 4
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.05, rms_norm_eps=1e-5,
    pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
)  # fmt: skip
# family -> (transformers config, transformers model, polyfuse model, config fields)
FAMILIES = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, Qwen2ForCausalLM, {}),
    # Qwen3Config.head_dim defaults to 128; 24 != hidden / heads, as in the real models.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, Qwen3ForCausalLM, {"head_dim": 24}),
}  # fmt: skip
# Sliding window 4: every layer for Mistral; the layers from max_window_layers on for Qwen (config.layer_types).
WINDOWED = {
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
}
LAYER_WINDOWS = {"mistral": [WINDOW, WINDOW], "qwen2": [None, WINDOW], "qwen3": [None, WINDOW]}


def hf_config(family: str, windowed: bool = False, **overrides):
    cfg_cls, _, _, extra = FAMILIES[family]
    return cfg_cls(**{**COMMON, **extra, **(WINDOWED[family] if windowed else {}), **overrides})


def hf_model(family: str, windowed: bool = False, seed: int = 0, **overrides):
    """transformers' model, fp32, eager attention, random weights with norms and biases moved off 1 and 0."""
    torch.manual_seed(seed)
    model = FAMILIES[family][1](hf_config(family, windowed, **overrides)).float()
    model.set_attn_implementation("eager")
    return perturb_(model, seed).eval()


@pytest.fixture(scope="module")
def make_pair(tmp_path_factory):
    """(transformers model, polyfuse model, folder): transformers' save_pretrained, then polyfuse's
    AutoModelForCausalLM.from_pretrained of that folder. Built once per (family, windowed)."""
    built = {}

    def make(family: str, windowed: bool = False):
        if (family, windowed) not in built:
            hf = hf_model(family, windowed)
            path = tmp_path_factory.mktemp(f"{family}{'_windowed' if windowed else ''}")
            hf.save_pretrained(path)
            built[family, windowed] = hf, AutoModelForCausalLM.from_pretrained(str(path)), path
        return built[family, windowed]

    return make


def polyfuse_greedy(model, ids, mask, n: int, **kw):
    """model.generate(..., ignore_eos=True) and the logits of every step it ran ([B, n, V]: prefill, then decode)."""
    steps = []
    step = model.step

    def recording(*args, **kwargs):
        logits = step(*args, **kwargs)
        steps.append(logits.clone())
        return logits

    model.step = recording  # the engine calls model.step for every prefill and decode step
    try:
        out = model.generate(ids, mask, max_new_tokens=n, ignore_eos=True, **kw)
    finally:
        del model.step
    return out, torch.stack(steps, 1)


@torch.no_grad()
def hf_greedy(hf, ids, mask, n: int):
    out = hf.generate(
        ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=PAD,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits, 1)


# -- transformers' checkpoint -> polyfuse: logits and greedy generation ---------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_checkpoint_logits_match(make_pair, family):
    hf, ours, path = make_pair(family)
    saved = json.loads((path / "config.json").read_text())
    assert saved["model_type"] == family and saved["architectures"] == [FAMILIES[family][1].__name__]
    assert type(ours) is FAMILIES[family][2]  # AutoModelForCausalLM picked the family from model_type
    assert ours.config.num_key_value_heads < ours.config.num_attention_heads  # GQA
    ids, mask = left_padded(random_rows((13, 7), VOCAB, seed=1))
    assert logits_diff(ours, hf, ids, mask) <= ATOL
    assert logits_diff(ours, hf, ids[:1]) <= ATOL  # no padding: plain causal attention
    labels = ids.masked_fill(mask == 0, -100)  # the training loss: fused linear cross-entropy vs transformers'
    with torch.no_grad():
        loss = ours(ids, attention_mask=mask, labels=labels).loss
        assert abs(loss.item() - hf(ids, attention_mask=mask, labels=labels).loss.item()) <= 1e-5
    # The tolerance means something: another seed's weights are far away.
    assert logits_diff(ours, hf_model(family, seed=1), ids[:1]) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batched_left_padded(make_pair, family):
    hf, ours, _ = make_pair(family)
    ids, mask = left_padded(random_rows((13, 7), VOCAB, seed=2))
    out, steps = polyfuse_greedy(ours, ids, mask, 16)
    want, want_steps = hf_greedy(hf, ids, mask, 16)
    assert out.shape == want.shape == (2, 13 + 16)
    assert torch.equal(out, want), f"\nours   {out}\ntheirs {want}"
    assert (steps - want_steps).abs().max().item() <= ATOL


# -- sliding window ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_sliding_window_generation(make_pair, family):
    hf, ours, _ = make_pair(family, windowed=True)
    if family != "mistral":  # transformers marks the layers past max_window_layers as sliding
        assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    assert [layer.self_attn.window for layer in ours.model.layers] == LAYER_WINDOWS[family]
    # Prompts of 14 and 9 tokens and 20 new ones: every step well past the 4-token window.
    ids, mask = left_padded(random_rows((14, 9), VOCAB, seed=3))
    out, steps = polyfuse_greedy(ours, ids, mask, 20)
    want, want_steps = hf_greedy(hf, ids, mask, 20)
    assert torch.equal(out, want), f"\nours   {out}\ntheirs {want}"
    assert (steps - want_steps).abs().max().item() <= ATOL
    # A KV length that grows in buckets (kv_len < cache length) and the full-sequence forward see the same window.
    assert torch.equal(polyfuse_greedy(ours, ids, mask, 20, bucket_size=8)[0], want)
    full_mask = torch.cat([mask, torch.ones(2, 20, dtype=mask.dtype)], 1)
    assert logits_diff(ours, hf, want, full_mask) <= ATOL
    # The window bites: transformers' model with the same weights and full attention gives other logits.
    full = hf_model(family)
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), hf.state_dict().values()))
    assert logits_diff(full, hf, want, full_mask) > 1e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernel through the CPU interpreter")
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_generation_triton_decode(make_pair, family, monkeypatch):
    """The whole windowed generation with every decode step on the Triton split-K decode kernel (interpreted)."""
    from polyfuse.backends.triton.decode_attention import accepts

    hf, ours, _ = make_pair(family, windowed=True)
    triton_decode, native = bound("attention", "triton_decode"), ours.kernels.attention
    windows = []

    def attention(q, k, v, meta):
        if not meta.decode:
            return native(q, k, v, meta)
        assert accepts(q, k, v, meta) is None  # the kernel runs, it does not hand the step to the native op
        windows.append(meta.window)
        return triton_decode(q, k, v, meta)

    monkeypatch.setattr(ours.kernels, "attention", attention)
    ids, mask = left_padded(random_rows((11, 6), VOCAB, seed=4))
    out, steps = polyfuse_greedy(ours, ids, mask, 12)
    want, want_steps = hf_greedy(hf, ids, mask, 12)
    assert sorted(set(windows), key=lambda w: w or 0) == sorted(set(LAYER_WINDOWS[family]), key=lambda w: w or 0)
    assert torch.equal(out, want), f"\nours   {out}\ntheirs {want}"
    assert (steps - want_steps).abs().max().item() <= ATOL


# -- save / load both ways -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_polyfuse_save_transformers_load(tmp_path, family):
    cls = FAMILIES[family][2]
    tied = {"tie_word_embeddings": family == "qwen2"}  # as the small Qwen2.5 checkpoints are
    ours = perturb_(cls.from_config(hf_config(family, windowed=True, **tied), seed=5), seed=5)
    ours.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [cls.hf_architecture] == [FAMILIES[family][1].__name__]
    assert saved["model_type"] == family
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, **{DTYPE_KW: torch.float32}, attn_implementation="eager"
    )
    assert type(hf) is FAMILIES[family][1]
    assert hf.config.sliding_window == WINDOW and hf.config.tie_word_embeddings == (family == "qwen2")
    ids, mask = left_padded(random_rows((14, 9), VOCAB, seed=5))
    assert logits_diff(ours, hf.eval(), ids, mask) <= ATOL
    # And back into polyfuse, the family picked from the saved model_type.
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert type(again) is cls
    assert logits_diff(again, ours, ids, mask) == 0.0


# -- GGUF ----------------------------------------------------------------------------------------------------------


def write_gguf(hf, arch: str, path: Path, types: dict = None) -> Path:
    """A float32 GGUF as llama.cpp's converter writes qwen2 / qwen3 (their q/k rows are not permuted); ``types``:
    {projection name: ggml type} of weights written quantized by the gguf package (biases stay float32)."""
    gguf = pytest.importorskip("gguf")  # a dependency, absent from some GPU images (make test-cuda)

    cfg = hf.config
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), 2)
    w = gguf.GGUFWriter(str(path), arch)
    add_gguf_shape(w, cfg)
    w.add_key_length(hf.model.layers[0].self_attn.head_dim)
    w.add_value_length(hf.model.layers[0].self_attn.head_dim)
    w.add_rope_freq_base(rope_parameters(cfg)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, t in hf.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: no output.weight, llama.cpp reads token_embd
        base, suffix = key.rsplit(".", 1)
        data = t.detach().float().numpy().astype(np.float32)
        ggml = next((v for part, v in (types or {}).items() if suffix == "weight" and base.endswith(part)), None)
        if ggml is None:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", data)
        else:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType[ggml])
            w.add_tensor(f"{names.get_name(base)}.{suffix}", q, raw_dtype=gguf.GGMLQuantizationType[ggml])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "family, overrides",
    [("qwen2", {"tie_word_embeddings": True, "rope_theta": 1e6}), ("qwen3", {"rope_theta": 1e6})],
    ids=["qwen2_tied", "qwen3"],
)
def test_gguf_matches_transformers(tmp_path, family, overrides):
    hf = hf_model(family, seed=6, **overrides)
    write_gguf(hf, family, tmp_path / f"tiny-{family}.gguf")
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"tiny-{family}.gguf")
    assert type(ours) is FAMILIES[family][2]
    assert ours.config.head_dim == hf.model.layers[0].self_attn.head_dim
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert rope_parameters(ours.config)["rope_theta"] == 1e6
    ids, mask = left_padded(random_rows((14, 9), VOCAB, seed=6))
    assert logits_diff(ours, hf, ids, mask) <= ATOL


def test_gguf_qkv_in_two_types_with_biases_is_kept_as_a_stack(tmp_path):
    """Qwen2 (q/k/v biases) from a GGUF whose q/k are Q8_0 and v Q4_0: q/k/v kept as a QLinearStack (one Q8_0 weight
    for q/k, one Q4_0 for v, then the fused bias), the logits of the same file loaded dequantized; saved and loaded
    back, the same logits."""
    from polyfuse.quant.qlinear import QLinearStack, quantized_modules

    hf = hf_model("qwen2", seed=8, hidden_size=64, intermediate_size=128)
    write_gguf(hf, "qwen2", tmp_path / "mixed.gguf", {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q4_0"})
    dense = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="mixed.gguf")
    kept = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="mixed.gguf", quant="gguf")
    qkv = kept.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QLinearStack) and qkv.bias is not None and qkv.bias.count_nonzero() > 0
    assert [q.format for q in qkv.segments] == ["gguf_q8_0", "gguf_q4_0"] and not quantized_modules(dense)
    assert torch.equal(qkv.bias, dense.model.layers[0].self_attn.qkv_proj.bias)
    ids, mask = left_padded(random_rows((3, 9), VOCAB, seed=8))
    assert logits_diff(kept, dense, ids, mask) <= 1e-5
    kept.save_pretrained(tmp_path / "saved")  # the bias under q/k/v_proj.bias, each part's packed weight in its type
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert isinstance(back.model.layers[0].self_attn.qkv_proj, QLinearStack)
    assert logits_diff(back, kept, ids, mask) == 0.0


# -- polyfuse.patch on transformers' models ------------------------------------------------------------------------

OPS = ("rms_norm", "add_rms_norm", "rotary", "attention", "swiglu", "linear_cross_entropy")


def spy_kernels():
    """CPU Kernels (attention through polyfuse, by override) whose ops count their calls."""
    k = resolve(SelectionContext(torch.device("cpu"), torch.float32, overrides="attention=native"))
    k.calls = dict.fromkeys(OPS, 0)
    for name in OPS:

        def wrapped(*a, _fn=getattr(k, name), _name=name, **kw):
            k.calls[_name] += 1
            return _fn(*a, **kw)

        setattr(k, name, wrapped)
    return k


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_transformers_model(family):
    ref = hf_model(family, windowed=True, seed=7)
    model = copy.deepcopy(ref)
    k = spy_kernels()
    handle = polyfuse.patch(model, kernels=k)
    norms = 5 + (4 if family == "qwen3" else 0)  # 2 per layer + the final one, + Qwen3's q/k norms per layer
    assert handle.patched == {
        "rms_norm": norms, "add_rms_norm": 2, "rotary": 2, "attention": 2, "swiglu": 2, "linear_cross_entropy": 1
    }  # fmt: skip
    assert model.config._attn_implementation == "polyfuse"
    ids, mask = left_padded(random_rows((14, 9), VOCAB, seed=7))
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        assert logits_diff(model, ref, ids, mask) <= ATOL
        assert logits_diff(model, ref, ids[:1]) <= ATOL
        loss, ref_loss = (
            model(ids, attention_mask=mask, labels=labels).loss,
            ref(ids, attention_mask=mask, labels=labels).loss,
        )
        assert abs(loss.item() - ref_loss.item()) <= 1e-5
        assert all(k.calls[op] > 0 for op in OPS), k.calls
        gen = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)
        assert torch.equal(model.generate(ids, **gen), ref.generate(ids, **gen))  # decode past the window, HF cache

    assert polyfuse.patch.unpatch(model)
    assert model.config._attn_implementation == "eager"
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    calls = dict(k.calls)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
    assert k.calls == calls


# -- the family from the checkpoint --------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(POLYFUSE_FAMILIES))
def test_auto_picks_family_from_model_type(tmp_path, model_type):
    cls = POLYFUSE_FAMILIES[model_type]
    extra = {"head_dim": 24} if model_type == "qwen3" else {}
    cls.from_config(cls.config_class(**COMMON, **extra)).save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model_type
    assert type(AutoModelForCausalLM.from_pretrained(str(tmp_path))) is cls
    other = next(c for t, c in POLYFUSE_FAMILIES.items() if t != model_type)
    with pytest.raises(CheckpointError, match=f"is not a {other.__name__}"):
        other.from_pretrained(str(tmp_path))


@pytest.fixture
def gpt2_folder(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2})
    )
    return tmp_path


@pytest.mark.parametrize("without_model_type", [False, True])
def test_unsupported_model_type(gpt2_folder, without_model_type):
    if without_model_type:  # only transformers' class name to go by
        (gpt2_folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError) as e:
        AutoModelForCausalLM.from_pretrained(str(gpt2_folder))
    message = str(e.value)
    assert "\n" not in message and "not supported" in message
    assert ("GPT2LMHeadModel" if without_model_type else "gpt2") in message
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        assert family in message, message


def test_unsupported_model_type_cli(gpt2_folder, capsys, monkeypatch):
    script = ROOT / "examples" / "run_generation.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model_name_or_path", str(gpt2_folder), "--device", "cpu"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(script), run_name="__main__")
    out, err = capsys.readouterr()
    assert e.value.code not in (0, None)
    assert "Traceback" not in out + err
    errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert "gpt2" in errors[0] and "qwen3" in errors[0]


# -- the attention implementations honour the window (transformers' rule) ------------------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (tests/conftest.py)


def hf_rule(key_mask, queries, kv_len: int, window):
    """bool [B, 1, Lq, kv_len] from transformers' own mask functions: key j visible to the query at absolute cache
    slot i iff it is real, j <= i and (with a window) i - j < window."""
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    fn = and_masks(fn, padding_mask_function(key_mask))
    b = torch.arange(key_mask.shape[0], device=key_mask.device)[:, None, None, None]
    return fn(b, None, queries[None, None, :, None], torch.arange(kv_len, device=key_mask.device)[None, None, None])


def qkv(b, lq, lk, seed, hq=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(DEVICE) for h, n in ((hq, lq), (hkv, lk), (hkv, lk))]


def padded_keys(b: int, lk: int, pad: int = 3):
    key_mask = torch.ones(b, lk, dtype=torch.bool, device=DEVICE)
    key_mask[1, :pad] = False
    return key_mask


@pytest.mark.parametrize("window", [None, 1, 4, 7])
def test_cache_mask_is_transformers_rule(window):
    key_mask = padded_keys(2, 40)
    queries = torch.tensor([0, 3, 5, 17, 39], device=DEVICE)
    allowed = cache_mask(key_mask, queries, 40, torch.float32, window) == 0
    assert torch.equal(allowed, hf_rule(key_mask, queries, 40, window))


@pytest.mark.parametrize("window", [None, 1, 4, 7])
def test_triton_decode_honours_window(window):
    """Lk = 150 runs as two splits (the CPU interpreter counts 2 SMs): the window may leave a whole split empty."""
    from polyfuse.backends.triton.decode_attention import accepts

    triton_decode, lk = bound("attention", "triton_decode"), 150
    key_mask = padded_keys(2, lk)
    for slot in (5, 70, 149):
        q, k, v = qkv(2, 1, lk, seed=slot)
        position = torch.tensor([slot], device=DEVICE)
        scale = 16**-0.5
        mask = cache_mask(key_mask, position, lk, torch.float32, window)
        assert torch.equal(mask == 0, hf_rule(key_mask, position, lk, window))
        want = attention_native(q, k, v, AttentionMeta(scale=scale, mask=mask))
        from_keys = AttentionMeta(scale=scale, decode=True, window=window, key_mask=key_mask, cache_position=position)
        from_mask = AttentionMeta(scale=scale, decode=True, window=window, mask=mask)
        for meta in (from_keys, from_mask):  # the boolean key mask + slot, or the additive mask
            assert accepts(q, k, v, meta) is None
            assert (triton_decode(q, k, v, meta) - want).abs().max().item() <= 1e-5
        if window is not None and slot >= window:  # the window changes the answer
            unwindowed = cache_mask(key_mask, position, lk, torch.float32, None)
            assert (attention_native(q, k, v, AttentionMeta(scale=scale, mask=unwindowed)) - want).abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 3])
def test_sdpa_honours_window(window):
    sdpa, scale = bound("attention", "sdpa_flash"), 16**-0.5
    # Prefill without padding: is_causal (+ window), no mask; q aligned to the last keys when Lq < Lk.
    for lq, lk in ((12, 12), (5, 12), (1, 12)):
        q, k, v = qkv(2, lq, lk, seed=lq)
        meta = AttentionMeta(scale=scale, is_causal=True, window=window)
        rule = hf_rule(
            torch.ones(2, lk, dtype=torch.bool, device=DEVICE), torch.arange(lk - lq, lk, device=DEVICE), lk, window
        )
        want = attention_native(
            q, k, v, AttentionMeta(scale=scale, mask=torch.zeros(()).masked_fill(~rule.cpu(), -1e30).to(DEVICE))
        )
        assert (sdpa(q, k, v, meta) - want).abs().max().item() <= 1e-5
        assert (attention_native(q, k, v, meta) - want).abs().max().item() <= 1e-5
    # Left-padded prefill and a decode step: the mask from the key mask and the cache slots.
    key_mask = padded_keys(2, 12)
    for positions in (torch.arange(12, device=DEVICE), torch.tensor([11], device=DEVICE)):
        q, k, v = qkv(2, len(positions), 12, seed=20 + len(positions))
        meta = AttentionMeta(
            scale=scale, mask=cache_mask(key_mask, positions, 12, torch.float32, window), window=window
        )
        meta.decode = len(positions) == 1
        keep = key_mask[:, None, positions, None].expand(-1, 4, -1, 16)  # padded query rows are garbage everywhere
        got, want = sdpa(q, k, v, meta), attention_native(q, k, v, meta)
        assert (got - want)[keep].abs().max().item() <= 1e-5
