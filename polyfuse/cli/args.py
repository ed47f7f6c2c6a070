"""run_generation.py's flags: optimum-habana's text-generation names and meanings, plus polyfuse's own."""

import argparse

from polyfuse.cli.kernel_options import add_kernel_options


class DefaultSteps(int):
    """--quant_tune_norms / --quant_tune_scales given without STEPS: the library's NORM_STEPS (128; not imported, so
    that this file needs no torch), told apart from an explicit 128 so that the other flag's STEPS can win."""


TUNE_STEPS = DefaultSteps(128)


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
        help="a local folder (config.json + safetensors, or exactly one .gguf), or a Hugging Face Hub id (org/name: "
        "downloaded with huggingface_hub, or read from its cache when offline); default: the built-in "
        "SmolLM2-135M-Instruct",
    )
    a(
        "--gguf_file",
        default=None,
        help="GGUF file inside --model_name_or_path (or an absolute path); needed when the folder holds several",
    )
    a(
        "--tokenizer",
        default=None,
        help="tokenizer folder, .gguf file or Hub id, for a checkpoint without one (save_pretrained writes none)",
    )
    a("--token", default=None, help="Hugging Face token for downloading a Hub id (ignored for local folders)")
    a(
        "--trust_remote_code",
        action="store_true",
        help="accepted for optimum-habana compatibility and ignored: polyfuse runs its own model code",
    )
    a("--device", "-d", default="auto", choices=["auto", "cpu", "cuda", "hpu"], help="auto: hpu, then cuda, then cpu")
    a("--prompt", nargs="*", default=None, help="one or more prompts (cycled to fill --batch_size)")
    a("--use_chat_template", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    a("--system_prompt", default=None, help="system message put before each prompt (implies --use_chat_template)")
    a(
        "--chat_file",
        default=None,
        help='JSON file with a conversation ([{"role": "user", "content": "..."}, ...]) or a list of them (one per '
        "batch row), ending with the user's turn; replaces --prompt, implies --use_chat_template",
    )
    a("--max_new_tokens", type=int, default=100, help="tokens to generate")
    a(
        "--max_input_tokens",
        type=int,
        default=0,
        help=">0: left-pad to this length, keeping the last tokens of longer prompts (truncated from the left, with "
        "a warning); <=0: full prompts padded to the longest (optimum-habana truncates to 16 at 0)",
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
    g.add_argument(
        "--cuda_graph_prefill",
        action="store_true",
        help="NVIDIA, with --use_cuda_graphs: capture the prompt step too, once per batch size and prompt length "
        "(pays when prompts share a length, e.g. with --max_input_tokens; each new length costs a capture, and the "
        "graphs keep the largest prompt's activations reserved)",
    )
    g.add_argument(
        "--torch_compile",
        action="store_true",
        help="torch.compile each op that runs its native reference (not module forwards; fused kernels run as they are)",
    )
    g.add_argument(
        "--bucket_size",
        type=int,
        default=None,
        help=">0: each decode step attends the KV cache up to its position rounded up to a multiple of this (graphs "
        "are captured per bucket); -1: no bucketing, every step attends prompt + max_new_tokens (optimum-habana's "
        "default); default: -1 on hpu, else 128 (larger for --max_new_tokens > 4096: at most 32 buckets)",
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
    g.add_argument(
        "--output_dir", default=None, help="write results.json here (outputs, Stats numbers and this run's arguments)"
    )
    g.add_argument(
        "--print_new_text_only",
        action="store_true",
        help="print (and save) only the generated text, not the prompt and chat template echoed before it",
    )
    g.add_argument(
        "--log_level",
        default="warning",
        choices=["debug", "info", "warning", "error", "critical"],
        help="level of polyfuse's and transformers' log messages",
    )
    # ---- generation features (transformers' generate options; passed by polyfuse/cli/generation_options.py) ----
    g = p.add_argument_group("generation features (transformers' generate semantics)")
    g.add_argument(
        "--num_beams",
        type=int,
        default=1,
        help="beam search with this many beams (beams are KV-cache rows; the decode step's graph replays, the greedy token graph is bypassed)",
    )
    g.add_argument(
        "--num_return_sequences",
        type=int,
        default=1,
        help="sequences per prompt: independent samples with --do_sample, or the best beams (<= --num_beams)",
    )
    g.add_argument(
        "--repetition_penalty",
        type=float,
        default=1.0,
        help="divide positive / multiply negative logits of ids already in the prompt or output (1.0: off)",
    )
    g.add_argument("--stop_strings", nargs="+", default=None, help="a row stops at the token completing one of these")
    g.add_argument("--stop_token_ids", nargs="+", type=int, default=None, help="extra ids that end a row like EOS")
    g.add_argument(
        "--stream",
        action="store_true",
        help="print the first generation's new text as tokens arrive (rank 0, --batch_size 1; one sync per token)",
    )
    # ---- end of generation features ----
    # ---- quantized weights (polyfuse/quant/quantize.py, docs/quantization.md) ----
    g = p.add_argument_group("quantized weights")
    g.add_argument(
        "--quant",
        default=None,
        choices=["fp8", "fp8_block", "int8", "int4", "gguf", "none"],
        help="quantize a float checkpoint's projections at load: fp8 (e4m3, per-channel scales), fp8_block (1x128 "
        "scales), int8 (per channel), int4 (AutoGPTQ layout, group 128); gguf: keep a GGUF's "
        "Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K tensors as stored; none: dequantize everything. Default: quantized checkpoints load as stored, a GGUF stays "
        "quantized where a kernel takes it (NVIDIA)",
    )
    g.add_argument(
        "--quant_lm_head",
        action="store_true",
        help="quantize the LM head too (after loading, in the format of --quant or of the checkpoint's projections; "
        "a tied head is untied, the input embedding keeps its dtype): ~5%% faster batch-1 decode for Llama-3-8B; a "
        "GGUF whose projections stay quantized keeps its own output.weight's blocks as stored (Q8_0 ... Q6_K)",
    )
    g.add_argument(
        "--quant_calibration",
        default=None,
        metavar="TEXT_FILE",
        help="with --quant int4, int8 or fp8: quantize by GPTQ instead of round to nearest, calibrated on this UTF-8 "
        "text (windows of 512 tokens, at most 64): the float model is loaded first, then each projection is "
        "quantized with its inputs on the text; the same layout and kernels. Use text like what the model will "
        "serve: calibrated on another kind of text GPTQ may do no better than round to nearest "
        "(docs/quantization.md, GPTQ)",
    )
    g.add_argument(
        "--quant_tune_norms",
        nargs="?",
        type=int,
        const=TUNE_STEPS,
        default=None,
        metavar="STEPS",
        help="with --quant_calibration: after quantizing, fit the RMSNorm weights (the projections stay as packed; "
        "--quant_tune_scales fits their scales) so that the quantized model's next-token distributions on the "
        "calibration text come back toward the float model's (KL; STEPS Adam steps of one 512-token window each, "
        "default 128); the layout and kernels are unchanged and a save carries the tuned norms (docs/quantization.md, "
        "Norm tuning)",
    )
    g.add_argument(
        "--quant_tune_scales",
        nargs="?",
        type=int,
        const=TUNE_STEPS,
        default=None,
        metavar="STEPS",
        help="with --quant_calibration: fit the quantized projections' scales the same way (each scale by a factor; "
        "the codes and int4's zero points stay as packed; default 128 steps); with --quant_tune_norms the norms and "
        "scales together, in the STEPS given to either (two different STEPS are an error); the layout and kernels "
        "are unchanged and a save carries the tuned scales (docs/quantization.md, Scale tuning)",
    )
    # ---- end of quantized weights ----
    add_kernel_options(p)
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
    "cuda_graph_prefill",
    "torch_compile",
    "bucket_size",
    "reuse_cache",
    "trim_logits",
)
