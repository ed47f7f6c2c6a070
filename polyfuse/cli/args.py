"""run_generation.py's flags: optimum-habana's text-generation names and meanings, plus polyfuse's own."""

import argparse


def _bool_or_none(value):
    v = str(value).lower()
    if v in ("1", "true", "yes", "y", "on"):
        return True
    if v in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_generation.py",
        description="Generate text with polyfuse's Llama (optimum-habana text-generation flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = p.add_argument
    a(
        "--model_name_or_path",
        default=None,
        help="local checkpoint folder (config.json + safetensors) or GGUF folder; default: the built-in SmolLM2-135M-Instruct",
    )
    a("--gguf_file", default=None, help="GGUF file inside --model_name_or_path (or an absolute path)")
    a("--device", "-d", default="auto", choices=["auto", "cpu", "cuda", "hpu"], help="auto: hpu, then cuda, then cpu")
    a("--prompt", nargs="*", default=None, help="one or more prompts (cycled to fill --batch_size)")
    a("--use_chat_template", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    a("--max_new_tokens", type=int, default=100, help="tokens to generate")
    a(
        "--max_input_tokens",
        type=int,
        default=0,
        help=">0: left-pad and truncate prompts to this length; <=0: full prompts padded to the longest (optimum-habana truncates to 16 at 0)",
    )
    a("--batch_size", type=int, default=1, help="prompts per batch")
    a("--bf16", action="store_true", help="run in bfloat16 (default float32)")
    a(
        "--use_kv_cache",
        action="store_true",
        help="decode against the static preallocated KV cache (otherwise recompute the whole sequence each token)",
    )
    a("--do_sample", action="store_true", help="sample instead of greedy decoding")
    a("--temperature", type=float, default=1.0)
    a("--top_k", type=int, default=None)
    a("--top_p", type=float, default=1.0)
    a("--seed", type=int, default=27)
    a(
        "--ignore_eos",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep generating past EOS (optimum-habana defaults to True for benchmarks)",
    )
    a("--warmup", type=int, default=3, help="warm-up iterations (graph capture / compilation happen here)")
    a("--n_iterations", type=int, default=5, help="timed iterations")
    g = p.add_argument_group("attention")
    g.add_argument(
        "--use_flash_attention",
        action="store_true",
        help="fused attention that never materializes L x L scores: FusedSDPA on Gaudi; on NVIDIA a Triton split-K decode kernel and SDPA flash/memory-efficient prefill; eager matmul+softmax otherwise",
    )
    g.add_argument("--flash_attention_recompute", action="store_true", help="Gaudi: recompute mode on the first token")
    g.add_argument(
        "--flash_attention_causal_mask",
        action="store_true",
        help="Gaudi: causal flag + valid sequence lengths on the first token",
    )
    g.add_argument(
        "--flash_attention_fast_softmax",
        nargs="?",
        const=True,
        default=None,
        type=_bool_or_none,
        help="Gaudi: fast softmax mode (default: on with --use_flash_attention on Gaudi; an explicit value wins)",
    )
    g.add_argument("--attn_softmax_bf16", action="store_true", help="Gaudi eager attention: softmax in bf16")
    g = p.add_argument_group("graphs and compilation")
    g.add_argument("--use_hpu_graphs", action="store_true", help="Gaudi: wrap the steps in HPU graphs")
    g.add_argument("--limit_hpu_graphs", action="store_true", help="Gaudi: no HPU graph for the first token")
    g.add_argument(
        "--use_cuda_graphs",
        action="store_true",
        help="NVIDIA: capture the whole decode step once per batch size and KV-cache length, replay per token",
    )
    g.add_argument("--torch_compile", action="store_true", help="torch.compile each op function (not module forwards)")
    g.add_argument(
        "--bucket_size",
        type=int,
        default=-1,
        help=">0: KV length grows in buckets of this size so graphs are reused; <=0: one static length (prompt + max_new_tokens)",
    )
    g.add_argument(
        "--reuse_cache",
        action="store_true",
        help="reuse the preallocated KV cache across calls (polyfuse always does)",
    )
    g.add_argument(
        "--trim_logits",
        action="store_true",
        help="LM head on the last position only at the first token (polyfuse always does)",
    )
    g = p.add_argument_group("polyfuse")
    g.add_argument(
        "--ops",
        default="",
        help="per-op overrides, e.g. '+rms_norm,-rotary,attention=sdpa_flash' (also env POLYFUSE_OPS)",
    )
    g.add_argument("--print_backends", action="store_true", help="print which implementation each op got and why")
    g.add_argument("--output_dir", default=None, help="write results.json here")
    return p


FLAG_NAMES = (
    "use_flash_attention",
    "flash_attention_recompute",
    "flash_attention_causal_mask",
    "flash_attention_fast_softmax",
    "attn_softmax_bf16",
    "use_hpu_graphs",
    "limit_hpu_graphs",
    "use_cuda_graphs",
    "torch_compile",
    "bucket_size",
    "reuse_cache",
    "trim_logits",
)
