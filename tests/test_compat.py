"""What polyfuse.compat smooths over between transformers 4.55 (what Gaudi's optimum-habana pins; ``make
test-compat`` runs this suite under it) and 5.x (``make test``): rotary settings given as 5.x's rope_parameters reach
every family's config, a 5.x config.json loads under 4.x, config sizes are type-checked on every version, a GGUF's
tokenizer follows the file's special tokens and is cached per transformers version, and Habana's fused clip-norm
runs inside the Trainer's loop on both (5.x has a _clip_grad_norm hook; 4.x calls accelerator.clip_grad_norm_)."""

import pytest
import torch
import transformers
from helpers import one_thread, tiny_llama  # noqa: F401  (autouse fixture)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from polyfuse import compat
from polyfuse.checkpoint.config import config_from_dict
from polyfuse.core.errors import CheckpointError
from polyfuse.models.rope import RotaryEmbedding


SIZES = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
    },
}  # fmt: skip


def _family(name):
    """(transformers config class, transformers' rotary embedding class) of a family."""
    return {
        "llama": (transformers.LlamaConfig, LlamaRotaryEmbedding),
        "mistral": (transformers.MistralConfig, MistralRotaryEmbedding),
        "qwen2": (transformers.Qwen2Config, Qwen2RotaryEmbedding),
        "qwen3": (transformers.Qwen3Config, Qwen3RotaryEmbedding),
    }[name]


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_rope_parameters_reach_every_family_config(family, rope):
    """make_config(rope_parameters=...) on either version: compat.rope_parameters reads it back, and both
    transformers' own rotary embedding and polyfuse's compute the same frequencies from it (a 4.x config given
    rope_parameters directly would keep rope_theta 10000 without a word)."""
    cfg_cls, hf_rotary = _family(family)
    config = compat.make_config(cfg_cls, **SIZES, rope_parameters=ROPES[rope])
    for key, value in ROPES[rope].items():
        assert compat.rope_parameters(config)[key] == value, key
    ours = RotaryEmbedding(config)
    ours.init_frequencies(torch.device("cpu"))
    theirs = hf_rotary(config=config)
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq.float(), rtol=1e-6, atol=0)
    assert ours.attention_scaling == pytest.approx(theirs.attention_scaling)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_json_of_either_version_loads(family):
    """A config.json written by transformers 5 (rope_parameters) and one written by 4.x (rope_theta +
    rope_scaling) give the same rotary settings under the installed transformers."""
    cfg_cls, _ = _family(family)
    new = {**SIZES, "model_type": family, "rope_parameters": dict(ROPES["linear"])}
    old = {
        **SIZES,
        "model_type": family,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }
    for raw in (new, old):
        params = compat.rope_parameters(config_from_dict(cfg_cls, raw, "config.json"))
        assert (params["rope_type"], params["rope_theta"], params["factor"]) == ("linear", 1000000.0, 2.0), raw


@pytest.mark.parametrize("value", ["big", 64.0, True, [64]])
def test_config_sizes_must_be_integers_on_every_version(value):
    raw = {**SIZES, "model_type": "llama", "hidden_size": value}
    with pytest.raises(CheckpointError) as e:
        config_from_dict(transformers.LlamaConfig, raw, "/ckpt")
    assert str(e.value) == f"/ckpt: invalid llama config (hidden_size must be an integer, got {value!r})"


def test_saved_config_records_dtype_as_transformers_reads_it(tmp_path):
    import json

    from polyfuse.models.llama import LlamaForCausalLM

    LlamaForCausalLM.from_config(compat.llama_config(**SIZES), dtype=torch.bfloat16).save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved[compat.DTYPE_KW] == "bfloat16"
    assert transformers.AutoConfig.from_pretrained(tmp_path).to_dict()[compat.DTYPE_KW] == "bfloat16"


def test_gguf_tokenizer_cache_is_per_transformers_version(tmp_path, monkeypatch):
    """5.x saves tokenizer_class "TokenizersBackend", which 4.x cannot load: each version converts its own."""
    from polyfuse.checkpoint import tokenizer as tok_mod

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    loads = []

    class FakeTokenizer:
        pad_token, eos_token = None, "</s>"

        def save_pretrained(self, path):
            import os

            os.makedirs(path, exist_ok=True)
            open(os.path.join(path, "tokenizer_config.json"), "w").write("{}")

    class FakeAuto:
        @staticmethod
        def from_pretrained(path, gguf_file=None):
            loads.append((str(path), gguf_file))
            return FakeTokenizer()

    monkeypatch.setenv("POLYFUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tok_mod, "AutoTokenizer", FakeAuto)
    monkeypatch.setattr(tok_mod, "_gguf_special_tokens", lambda tok, file: None)  # m.gguf has no metadata
    for version in ("4.55.4", "5.17.0", "4.55.4"):
        monkeypatch.setattr(tok_mod.transformers, "__version__", version)
        tok_mod.load_tokenizer(str(tmp_path), "m.gguf")
    converted = [p for p, g in loads if g == "m.gguf"]
    cached = [p for p, g in loads if g is None]
    assert len(converted) == 2 and len(cached) == 1  # one conversion per version; the third load is a cache hit
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2


def test_builtin_gguf_tokenizer_follows_the_file():
    """The built-in SmolLM2 GGUF says bos 1 (<|im_start|>), eos 2 (<|im_end|>), no BOS prepended. transformers 4.55's
    conversion makes <|im_start|> the EOS too and prepends a BOS; load_tokenizer corrects both."""
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    try:
        tok = load_tokenizer(*builtin_model())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", 1, "<|im_end|>", 2)
    assert tok("").input_ids == [] and tok("Hello").input_ids == [19556]


def test_fused_clip_norm_runs_in_the_training_loop(tmp_path):
    """GaudiConfig use_fused_clip_norm: the runtime's fused clip replaces the Trainer's own clipping, every optimizer
    step, through _clip_grad_norm (transformers 5) or accelerator.clip_grad_norm_ (4.x, which has no hook)."""
    from polyfuse.training import PolyfuseTrainer, PolyfuseTrainingArguments
    from polyfuse.training.gaudi_config import GaudiConfig

    calls = []

    class FakeFusedClipNorm:  # Habana's FusedClipNorm: built once with max_norm, then clip_norm(params) each step
        def __init__(self, params, max_norm):
            self.max_norm = max_norm

        def clip_norm(self, params):
            params = list(params)
            calls.append(len(params))
            return torch.nn.utils.clip_grad_norm_(params, self.max_norm)

    args = PolyfuseTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, max_grad_norm=0.5, report_to=[],
        use_cpu=True, disable_tqdm=True, save_strategy="no", dataloader_num_workers=0,
    )  # fmt: skip
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r.clone()} for r in ids]
    trainer = PolyfuseTrainer(tiny_llama(), args, train_dataset=data)
    # A Gaudi run without a Gaudi: use_habana and the gaudi config set after the checks, the runtime's hook faked.
    args.use_habana, trainer.gaudi_config = True, GaudiConfig(use_fused_clip_norm=True)
    trainer.runtime.fused_clip_norm = FakeFusedClipNorm
    trainer.train()
    n_params = sum(1 for _ in trainer.model.parameters())
    assert calls == [n_params, n_params]
