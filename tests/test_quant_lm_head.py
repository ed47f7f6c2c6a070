"""--quant_lm_head (quant/quantize.py quantize_lm_head_): the LM head packed after loading, untied where it was
tied, computed by the linear_q ops in forward (the loss from its logits) and in decode steps, saved with the checkpoint (AutoGPTQ's
``lm_head: true``, polyfuse's ``formats``) and loaded back as stored; what it refuses."""

import json

import pytest
import torch
from helpers import one_thread, tiny_config  # noqa: F401  (one_thread: autouse fixture)

from polyfuse.models.llama import LlamaForCausalLM
from polyfuse.ops import quant_formats as qf
from polyfuse.quant import quantize as qz
from polyfuse.quant.qlinear import QLinear
from polyfuse.quant.report import report


IDS = torch.randint(10, 300, (2, 9), generator=torch.Generator().manual_seed(7))


def logits(model):
    with torch.inference_mode():
        return model(IDS).logits


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    cfg = tiny_config(tie_word_embeddings=request.param, vocab_size=304)  # int4 packs 8 rows per zeros word
    LlamaForCausalLM.from_config(cfg, seed=3).save_pretrained(str(path))
    return str(path), request.param


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_head_packed_in_forward_and_decode_saved_and_loaded_back(tiny_dir, tmp_path, monkeypatch, fmt):
    path, tied = tiny_dir
    model = LlamaForCausalLM.from_pretrained(path, quant=fmt)
    emb = model.model.embed_tokens.weight.detach().clone()
    head_w = model.lm_head.weight.detach().clone()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert qz.quantize_lm_head_(model) is True  # the format of the model's projections
    head = model.lm_head
    assert isinstance(head, QLinear) and head.format == fmt and not model.config.tie_word_embeddings
    assert torch.equal(model.model.embed_tokens.weight, emb)  # the input embedding untouched
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    # The same model with the dequantized head as a float head: equal logits (native linear_q = dequantize + linear).
    ref = LlamaForCausalLM.from_pretrained(path, quant=fmt)
    ref.config.tie_word_embeddings = False
    ref.lm_head.weight = torch.nn.Parameter(qf.dequantize(head.quantized_weight(), torch.float32))
    out = logits(model)
    torch.testing.assert_close(out, logits(ref), rtol=1e-5, atol=1e-5)
    assert (out - logits(LlamaForCausalLM.from_pretrained(path, quant=fmt))).abs().max() > 0  # the head did change
    assert qf.dequantize(head.quantized_weight(), torch.float32).sub(head_w).abs().max() < 0.05
    gen = model.generate(IDS, max_new_tokens=6, ignore_eos=True)  # decode steps through head_logits
    assert torch.equal(gen, ref.generate(IDS, max_new_tokens=6, ignore_eos=True))
    assert "other projection(s) in float32" in report(model)
    # Saved with the packed head and an untied config; loaded back as stored (nothing quantized again).
    model.save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    qc = cfg["quantization_config"]
    assert qc["lm_head"] is True if fmt == "int4" else qc["formats"]["lm_head"] == fmt
    monkeypatch.setattr(qz, "quantize_components", lambda *a, **k: pytest.fail("quantized again"))
    again = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert isinstance(again.lm_head, QLinear) and again.lm_head.format == fmt
    assert torch.equal(logits(again), out)
    assert torch.equal(again.model.embed_tokens.weight, emb)
    dense = LlamaForCausalLM.from_pretrained(str(tmp_path), quant="none")  # --quant none: a float head again
    assert not isinstance(dense.lm_head, QLinear)
    torch.testing.assert_close(logits(dense), out, rtol=1e-5, atol=1e-5)


def test_refusals_the_loss_and_the_format_that_cannot_pack(tiny_dir, caplog):
    path, _ = tiny_dir
    model = LlamaForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="give the format"):
        qz.quantize_lm_head_(model)  # nothing quantized: which format?
    with pytest.raises(ValueError, match="choose one of"):
        qz.quantize_lm_head_(model, "q4_0")
    qz.quantize_lm_head_(model, "int8")
    with torch.no_grad():  # the loss (perplexity) from the packed head's logits, not the fused float-head loss
        loss = model(IDS, labels=IDS).loss
        want = torch.nn.functional.cross_entropy(logits(model)[:, :-1].reshape(-1, 304), IDS[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, want)
    odd = LlamaForCausalLM.from_config(tiny_config())  # 301 vocabulary rows: int4 packs zeros 8 rows to a word
    assert qz.quantize_lm_head_(odd, "int4") is False and not isinstance(odd.lm_head, QLinear)
    assert any("--quant_lm_head int4" in r.getMessage() and "keeps the run's dtype" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_cli_quant_lm_head(tiny_dir, tmp_path, capsys):
    from polyfuse.cli.generate import main

    path, _ = tiny_dir
    common = ["--model_name_or_path", path, "--tokenizer", "none", "--max_new_tokens", "3", "--use_kv_cache"]
    rc = main(common + ["--quant_lm_head"])
    err = capsys.readouterr().err
    assert rc != 0 and err.strip().splitlines()[-1].startswith("error: --quant_lm_head: give the format"), err
    assert "Traceback" not in err


def test_tied_config_with_a_packed_head_loads_untied(tmp_path, caplog):
    """A checkpoint whose config says tied but which holds a packed lm_head (a GPTQ model with ``lm_head: true`` on a
    tied model): untied before loading, one warning; as stored the head is the packed one, with --quant none its
    dequantization, and the embedding keeps its own weights either way."""
    src = LlamaForCausalLM.from_config(tiny_config(tie_word_embeddings=True, vocab_size=304), seed=5)
    emb = src.model.embed_tokens.weight.detach().clone()
    qz.quantize_lm_head_(src, "int8")
    out = logits(src)
    packed = qf.dequantize(src.lm_head.quantized_weight(), torch.float32)
    src.save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING", logger="polyfuse"):
        stored = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert sum("holds a packed lm_head" in r.getMessage() for r in caplog.records) == 1
    assert isinstance(stored.lm_head, QLinear) and torch.equal(stored.model.embed_tokens.weight, emb)
    assert torch.equal(logits(stored), out)
    dense = LlamaForCausalLM.from_pretrained(str(tmp_path), quant="none")
    assert dense.lm_head.weight is not dense.model.embed_tokens.weight and not dense.config.tie_word_embeddings
    assert torch.equal(dense.lm_head.weight, packed) and torch.equal(dense.model.embed_tokens.weight, emb)


def test_quantizing_after_a_generate_drops_the_steppers(tiny_dir):
    """Graphs captured by an earlier generate() read the float head: quantize_lm_head_ drops the model's steppers."""

    model = LlamaForCausalLM.from_pretrained(tiny_dir[0], quant="int8")
    model.generate(IDS, max_new_tokens=2, ignore_eos=True)
    assert model.steps is not None
    qz.quantize_lm_head_(model)
    assert model.steps is None


@pytest.mark.parametrize("fmt", ["gguf_q6_k", "gguf_q4_0"])
def test_head_in_a_gguf_type(fmt):
    """quantize_lm_head_ in a GGUF type (benchmark_generation.py --quant gguf_q4_k --quant_lm_head gguf_q6_k): the
    head packed in llama.cpp's blocks by round to nearest computes what its dequantized blocks do as a float head."""
    model = LlamaForCausalLM.from_config(tiny_config(hidden_size=256, vocab_size=304), seed=3)
    dense = LlamaForCausalLM.from_config(tiny_config(hidden_size=256, vocab_size=304), seed=3)
    assert qz.quantize_lm_head_(model, fmt) and model.lm_head.format == fmt
    with torch.no_grad():
        blocks = qf.dequantize(model.lm_head.quantized_weight(), torch.float32)
        assert (blocks - dense.lm_head.weight).abs().max() > 0  # rounded: not the float head
        dense.lm_head.weight.copy_(blocks)
    torch.testing.assert_close(logits(model), logits(dense), rtol=1e-5, atol=1e-5)
