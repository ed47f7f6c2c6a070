"""polyfuse.patch on a transformers Llama: same logits, loss and gradients as unpatched, every op routed through
the Kernels, and unpatch restores the exact original behaviour."""

import copy

import pytest
import torch
from helpers import tiny_llama
from torch import nn

from polyfuse.core.registry import SelectionContext, resolve
from polyfuse.patch import patch, unpatch


OPS = ("rms_norm", "add_rms_norm", "rotary", "attention", "swiglu", "linear_cross_entropy")


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in row 1
    return ids, mask


def spy_kernels(overrides="attention=native"):
    """Kernels whose every op counts its calls, so a test fails if the patch does not route through them."""
    k = resolve(SelectionContext(torch.device("cpu"), torch.float32, training=True, overrides=overrides))
    k.calls = dict.fromkeys(OPS, 0)
    for name in OPS:
        fn = getattr(k, name)

        def wrapped(*a, _fn=fn, _name=name, **kw):
            k.calls[_name] += 1
            return _fn(*a, **kw)

        setattr(k, name, wrapped)
    return k


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_patched_logits_loss_grads_match(batch, attn):
    ids, mask = batch
    ref = tiny_llama(attn=attn)
    model = copy.deepcopy(ref)
    k = spy_kernels()
    handle = patch(model, kernels=k)
    assert handle.patched == {
        "rms_norm": 5,
        "add_rms_norm": 2,
        "rotary": 2,
        "attention": 2,
        "swiglu": 2,
        "linear_cross_entropy": 1,
    }
    assert model.config._attn_implementation == "polyfuse"

    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    keep = mask.bool()  # padded query positions are garbage in every attention path; compare real tokens
    torch.testing.assert_close(
        model(ids, attention_mask=mask).logits[keep], ref(ids, attention_mask=mask).logits[keep], atol=1e-5, rtol=1e-5
    )
    labels = ids.clone()
    labels[1, :6] = -100  # label t+1 is predicted at t: no label predicted from a padded position
    out = model(ids, attention_mask=mask, labels=labels)
    ref_out = ref(ids, attention_mask=mask, labels=labels)
    assert out.logits is None  # the fused loss never materializes logits
    torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-6, rtol=1e-6)
    out.loss.backward()
    ref_out.loss.backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-6, rtol=1e-5, msg=name)
    # every op went through the Kernels (2 layers: 4 + 1 norms, add_rms_norm x2, rotary x2, ...)
    assert all(k.calls[op] > 0 for op in OPS), k.calls


def test_num_items_in_batch_and_generate(batch):
    ids, _ = batch
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    patch(model, overrides="attention=native")
    n = torch.tensor(17)
    torch.testing.assert_close(
        model(ids, labels=ids, num_items_in_batch=n).loss, ref(ids, labels=ids, num_items_in_batch=n).loss
    )
    prompt = ids[:1, :6]
    torch.testing.assert_close(
        model.generate(prompt, max_new_tokens=6, do_sample=False),
        ref.generate(prompt, max_new_tokens=6, do_sample=False),
    )


def test_unpatch_restores_exactly(batch):
    ids, mask = batch
    model = tiny_llama()
    before = model(ids, attention_mask=mask).logits
    assert not torch.isnan(before).any()
    before_loss = model(ids, labels=ids).loss
    patch(model, overrides="attention=native")
    patch(model, overrides="attention=native")  # patching twice re-patches, unpatch still restores the original
    assert unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    for m in model.modules():
        assert "forward" not in m.__dict__ and "_polyfuse_kernels" not in m.__dict__
    assert torch.equal(model(ids, attention_mask=mask).logits, before)
    assert torch.equal(model(ids, labels=ids).loss, before_loss)
    assert not unpatch(model)


def test_native_attention_choice_keeps_hf_attention(batch):
    model = tiny_llama()
    handle = patch(model)  # on CPU the registry picks native attention: transformers' sdpa stays
    assert model.config._attn_implementation == "sdpa"
    assert handle.patched["attention"] == 0 and handle.patched["rotary"] == 2
    assert "keeps transformers' 'sdpa'" in handle.report()


class FakeModulesToSave(nn.Module):
    """The shape of PEFT's ModulesToSaveWrapper (peft is not a dependency)."""

    def __init__(self, module):
        super().__init__()
        self.original_module = module
        self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(module)})
        self.active_adapter = "default"

    def forward(self, x):
        return self.modules_to_save["default"](x)


def test_peft_style_wrappers(batch):
    ids, _ = batch
    ref = tiny_llama()
    ref.config.tie_word_embeddings = False
    ref.lm_head = FakeModulesToSave(ref.lm_head)
    with torch.no_grad():
        ref.lm_head.modules_to_save["default"].weight.mul_(2)  # the trained copy differs from the original
    layer = ref.model.layers[0]
    layer.input_layernorm = FakeModulesToSave(layer.input_layernorm)
    model = copy.deepcopy(ref)
    k = spy_kernels()
    handle = patch(model, kernels=k)
    assert handle.patched["rms_norm"] == 6  # both copies inside the wrapper
    torch.testing.assert_close(model(ids, labels=ids).loss, ref(ids, labels=ids).loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    assert k.calls["linear_cross_entropy"] == 1


def test_patch_rejects_non_llama():
    with pytest.raises(TypeError, match="Llama"):
        patch(nn.Linear(2, 2))


def test_rotary_follows_transformers_dtype_promotion_under_autocast(batch):
    """Under bf16 autocast transformers' rotary gives float32 q/k (bf16 q times float32 cos); the patched rotary must
    too, or the loss drifts by about half a percent per step."""
    ids, _ = batch
    ref = tiny_llama(attn="eager")
    model = copy.deepcopy(ref)
    patch(model, overrides="attention=native")
    rotated = []
    k = find_kernels(model)
    rotary = k.rotary

    def spy(q, kk, cos, sin):
        out = rotary(q, kk, cos, sin)
        rotated.append(out[0].dtype)
        return out

    k.rotary = spy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(input_ids=ids, labels=ids).loss
        got = model(input_ids=ids, labels=ids).loss
    assert rotated and set(rotated) == {torch.float32}
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=0)


def find_kernels(model):
    from polyfuse.patch.hf import find_handle

    return find_handle(model).kernels
