"""A cached step of several tokens (the prefill) runs its last layer's attention for the last query only and that
layer's o projection and MLP on the last row (``DecoderForCausalLM.prune_last_layer``): the same logits, tokens and
cache as running every row, for every family, with left padding, sliding windows and quantized weights."""

import pytest
import torch
import transformers
from helpers import BOS, EOS, PAD, left_padded, one_thread, perturb_, random_rows  # noqa: F401

from polyfuse.models import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=PAD, bos_token_id=BOS,
    eos_token_id=EOS, tie_word_embeddings=False,
)  # fmt: skip
# family -> (transformers config, polyfuse model, config fields): Mistral windowed on every layer, Qwen2 past
# max_window_layers (the last layer windowed), Qwen3 with q/k norms and a head_dim of its own
FAMILIES = {
    "llama": (transformers.LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, MistralForCausalLM, {"sliding_window": 4}),
    "qwen2": (
        transformers.Qwen2Config, Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
    ),
    "qwen3": (transformers.Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24}),
}  # fmt: skip


def build(family: str, quant=None):
    cfg_cls, model_cls, extra = FAMILIES[family]
    model = model_cls.from_config(cfg_cls(**COMMON, **extra), seed=3, quant=quant)
    return perturb_(model, 3).eval()


def run(model, ids, mask, prune: bool, n: int = 6):
    """(tokens, per-step logits [B, steps, V], the rows of each step's last-layer MLP output, the last layer's
    cache after the prefill) with the pruning on or off."""
    model.prune_last_layer = prune
    steps, mlp_rows, caches = [], [], []
    step = model.step
    last = model.model.layers[-1]

    def recording(*args, **kwargs):
        logits = step(*args, **kwargs)
        steps.append(logits.clone())
        if len(steps) == 1:
            n = args[0].shape[1]  # the prompt's slots (later ones hold what an earlier run left)
            caches.append((model.cache.k[-1][:, :, :n].clone(), model.cache.v[-1][:, :, :n].clone()))
        return logits

    handle = last.mlp.register_forward_hook(lambda mod, args, out: mlp_rows.append(out.shape[1]))
    model.step = recording
    try:
        out = model.generate(ids, mask, max_new_tokens=n, ignore_eos=True)
    finally:
        del model.step
        handle.remove()
        model.prune_last_layer = True
    return out, torch.stack(steps, 1), mlp_rows, caches[0]


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_last_row_prefill_equals_every_row(family, quant):
    model = build(family, quant)
    if family == "qwen2":
        assert [layer.self_attn.window for layer in model.model.layers] == [None, None, 4]
    for rows in ((13, 7), (11,)):  # left padding, then one unpadded prompt (no key mask)
        ids, mask = left_padded(random_rows(rows, VOCAB, seed=5))
        if len(rows) == 1:
            mask = None
        out, steps, mlp_rows, cache = run(model, ids, mask, prune=True)
        ref_out, ref_steps, ref_rows, ref_cache = run(model, ids, mask, prune=False)
        # the pruned prefill ran the last layer's MLP on one row, the reference on all; decode steps on one either way
        assert mlp_rows == [1] * len(mlp_rows) and ref_rows == [ids.shape[1]] + [1] * (len(ref_rows) - 1)
        assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])
        scale = ref_steps.abs().max().item()
        assert (steps - ref_steps).abs().max().item() <= 1e-5 * scale
        assert torch.equal(out, ref_out)


def test_last_row_prefill_differs_from_a_wrong_row():
    """The comparison can fail: attending from the first query instead of the last gives other logits."""
    model = build("llama")
    ids, mask = left_padded(random_rows((13, 7), VOCAB, seed=5))
    _, ref_steps, _, _ = run(model, ids, mask, prune=False)
    last_query_metas = model.last_query_metas

    def first_slot(batch, key_mask, cache_position, kv_len):
        return last_query_metas(batch, key_mask, cache_position[:1], kv_len)

    model.last_query_metas = first_slot
    try:
        _, steps, _, _ = run(model, ids, mask, prune=True)
    finally:
        del model.last_query_metas
    assert (steps[:, 0] - ref_steps[:, 0]).abs().max().item() > 1e-2 * ref_steps.abs().max().item()
