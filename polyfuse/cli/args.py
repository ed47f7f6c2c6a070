"""polyfuse-generate's (examples/run_generation.py's) flags: optimum-habana's text-generation names and meanings, plus
polyfuse's own, in groups; every option has help and shows its default. Long explanations live in README.md and
docs/, not in --help."""

import argparse
import difflib
import os
import re
import sys

from polyfuse.cli.habana_options import add_habana_options
from polyfuse.cli.kernel_options import add_kernel_options
from polyfuse.cli.speculative_options import add_speculative_options


class DefaultSteps(int):
    """--quant_tune_norms / --quant_tune_scales given without STEPS: the library's NORM_STEPS (128; not imported, so
    that this file needs no torch), told apart from an explicit 128 so that the other flag's STEPS can win."""


TUNE_STEPS = DefaultSteps(128)
DTYPES = ("bfloat16", "float16", "float32")
# The names this program is started by; anything else (python -m, pytest) is called polyfuse-generate.
PROG_NAMES = ("polyfuse-generate", "run_generation.py")


def _bool_or_none(value):
    v = str(value).lower()
    if v in ("1", "true", "yes", "y", "on"):
        return True
    if v in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def program_name() -> str:
    name = os.path.basename(sys.argv[0] or "")
    return name if name in PROG_NAMES else PROG_NAMES[0]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after every option's help unless the help already says its default; wide help column."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=34)

    def _get_help_string(self, action):
        text = action.help or ""
        if "default:" in text or "%(default)" in text or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction):  # a flag: off unless given (the description says so)
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Bad command lines are one ``error:`` line (an unknown flag with the closest known one), not the usage."""

    def error(self, message):
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            words = [w for w in unknown.group(1).split() if w.startswith("-")] or unknown.group(1).split()
            hints = []
            for word in words:
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.75)
                hints.append(f"{word} (did you mean {close[0]}?)" if close else word)
            message = f"unrecognized argument{'s' if len(words) > 1 else ''}: {', '.join(hints)}"
        self.exit(2, f"error: {message}; {self.prog} --help lists the options\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=program_name(),
        usage="%(prog)s [--model_name_or_path PATH] [--prompt TEXT ...] [options]",
        description="Generate text with polyfuse (optimum-habana text-generation flags). Without "
        "--model_name_or_path it runs the built-in SmolLM2-135M-Instruct, a chat model: give --use_chat_template. "
        "Flags (options without a value) are off unless given.",
        formatter_class=HelpFormatter,
    )
    _model_options(p)
    _input_options(p)
    _generation_options(p)
    _device_options(p)
    add_kernel_options(p)  # polyfuse/cli/kernel_options.py
    _quant_options(p)
    _gaudi_options(p)
    _output_options(p)
    add_speculative_options(p)  # polyfuse/cli/speculative_options.py
    add_habana_options(p)  # polyfuse/cli/habana_options.py: the rest of optimum-habana's run_generation.py flags
    return p


def _model_options(p) -> None:
    g = p.add_argument_group("model")
    a = g.add_argument
    a("--model_name_or_path", default=None, metavar="PATH",
      help="a local folder (config.json + safetensors, or exactly one .gguf), a .gguf file, or a Hugging Face Hub id "
      "(org/name; read from the cache when offline) (default: the built-in SmolLM2-135M-Instruct)")  # fmt: skip
    a("--gguf_file", default=None, metavar="FILE", help="the GGUF in --model_name_or_path if it holds several")
    a("--tokenizer", default=None, metavar="PATH", help="tokenizer folder, .gguf or Hub id (default: the model's)")
    a("--token", default=None, help="Hugging Face token, for downloading a Hub id")
    a("--trust_remote_code", action="store_true", help="accepted and ignored: polyfuse runs its own model code")
    a(
        "--dtype",
        default=None,
        choices=DTYPES,
        metavar="{" + ",".join(DTYPES) + "}",
        help="weights and activations (default: float32; bfloat16 with --bf16)",
    )
    a("--bf16", action="store_true", help="the same as --dtype bfloat16 (optimum-habana's flag)")


def _input_options(p) -> None:
    g = p.add_argument_group("input")
    a = g.add_argument
    a("--prompt", nargs="*", default=None, metavar="TEXT",
      help="one or more prompts, run in groups of --batch_size (fewer are cycled to fill one batch) "
      "(default: 'DeepSpeed is a machine learning framework')")  # fmt: skip
    a("--prompt_file", default=None, metavar="FILE", help="UTF-8 text, a prompt per non-blank line")
    a("--chat_file", default=None, metavar="FILE",
      help='JSON conversation ([{"role": "user", "content": "..."}, ...]) or a list of them, each ending with the '
      "user's turn; implies --use_chat_template")  # fmt: skip
    a("--use_chat_template", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    a(
        "--system_prompt",
        default=None,
        metavar="TEXT",
        help="system message before each prompt (implies --use_chat_template)",
    )
    a("--batch_size", type=int, default=1, metavar="N", help="prompts per batch")
    a("--max_input_tokens", type=int, default=0, metavar="N",
      help=">0: left-pad or left-truncate every prompt to this many tokens; <=0: pad to the longest")  # fmt: skip


def _generation_options(p) -> None:
    g = p.add_argument_group("generation")
    a = g.add_argument
    a("--max_new_tokens", type=int, default=100, metavar="N", help="tokens to generate")
    a("--use_kv_cache", action="store_true", help="decode on the static KV cache (else recompute every token)")
    a("--do_sample", action="store_true", help="sample instead of greedy decoding")
    a("--temperature", type=float, default=1.0, metavar="T", help="sampling temperature (with --do_sample)")
    a(
        "--top_k",
        type=int,
        default=None,
        metavar="K",
        help="k most likely tokens (None: all)",
    )
    a(
        "--top_p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling: smallest set of this probability",
    )
    a("--seed", type=int, default=27, metavar="N", help="random seed (sampling)")
    a("--ignore_eos", action=argparse.BooleanOptionalAction, default=True,
      help="keep generating past EOS (optimum-habana's default; --no-ignore_eos stops at it)")  # fmt: skip
    a("--num_beams", type=int, default=1, metavar="N", help="beam search with this many beams")
    a("--num_return_sequences", type=int, default=1, metavar="N",
      help="per prompt (--do_sample, or <= --num_beams)")  # fmt: skip
    a("--repetition_penalty", type=float, default=1.0, metavar="X", help="transformers' repetition penalty (1.0: off)")
    a(
        "--stop_strings",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="a row stops at the token completing one of these",
    )
    a(
        "--stop_token_ids",
        nargs="+",
        type=int,
        default=None,
        metavar="ID",
        help="extra token ids that end a row like EOS",
    )


def _device_options(p) -> None:
    g = p.add_argument_group("device and kernels")
    a = g.add_argument
    a(
        "--device",
        "-d",
        default="auto",
        choices=["auto", "cpu", "cuda", "hpu"],
        metavar="{auto,cpu,cuda,hpu}",
        help="auto: hpu, then cuda, then cpu",
    )
    a("--use_flash_attention", nargs="?", const=True, default=False, type=_bool_or_none, metavar="BOOL",
      help="fused attention (Gaudi FusedSDPA; NVIDIA: Triton decode + SDPA flash prefill); else eager")  # fmt: skip
    a("--use_cuda_graphs", action="store_true", help="NVIDIA: replay the decode step as a CUDA graph")
    a("--cuda_graph_prefill", action="store_true", help="NVIDIA, with --use_cuda_graphs: graph the prompt step too")
    a(
        "--torch_compile",
        action="store_true",
        help="Gaudi: torch.compile the whole decoder (hpu_backend); elsewhere the ops that run their native reference",
    )
    a("--bucket_size", type=int, default=None, metavar="N",
      help=">0: decode steps attend the KV cache rounded up to this; -1: the whole cache "
      "(default: -1 on hpu, else 128, wider past 4096 new tokens)")  # fmt: skip
    a("--ops", default="", metavar="LIST", help="per-op overrides, e.g. '+rms_norm,-rotary,attention=sdpa_flash' "
      "(default: none)")  # fmt: skip
    a("--print_backends", action="store_true", help="print which implementation each op got and why")


def _quant_options(p) -> None:
    g = p.add_argument_group("quantized weights (docs/quantization.md)")
    a = g.add_argument
    a("--quant", default=None, choices=["fp8", "fp8_block", "int8", "int4", "gguf", "none"], metavar="FORMAT",
      help="fp8, fp8_block, int8 or int4: quantize a float checkpoint's projections at load; gguf: keep a GGUF's "
      "blocks; none: dequantize (default: load as stored)")  # fmt: skip
    a("--quant_lm_head", action="store_true", help="quantize the LM head too")
    a("--quant_calibration", default=None, metavar="TEXT_FILE",
      help="with --quant int4/int8/fp8: GPTQ calibrated on this text (up to 32768 tokens used) instead of "
      "round to nearest")  # fmt: skip
    for flag, what in (
        ("--quant_tune_norms", "the RMSNorm weights"),
        ("--quant_tune_scales", "the projections' scales"),
    ):
        a(flag, nargs="?", type=int, const=TUNE_STEPS, default=None, metavar="STEPS",
          help=f"with --quant_calibration: fit {what} toward the float model, STEPS Adam steps (128 when given "
          "alone)")  # fmt: skip


def _gaudi_options(p) -> None:
    g = p.add_argument_group("Gaudi compatibility (optimum-habana flags; other devices warn and run without them)")
    a = g.add_argument
    a("--use_hpu_graphs", action="store_true", help="wrap the steps in HPU graphs")
    a("--limit_hpu_graphs", action="store_true", help="no HPU graph for the first token")
    a(
        "--flash_attention_recompute",
        nargs="?",
        const=True,
        default=False,
        type=_bool_or_none,
        metavar="BOOL",
        help="FusedSDPA recompute mode on the first token",
    )
    a(
        "--flash_attention_causal_mask",
        nargs="?",
        const=True,
        default=False,
        type=_bool_or_none,
        metavar="BOOL",
        help="FusedSDPA causal flag + valid sequence lengths",
    )
    a("--flash_attention_fast_softmax", nargs="?", const=True, default=None, type=_bool_or_none, metavar="BOOL",
      help="FusedSDPA fast softmax (default: on with --use_flash_attention on Gaudi)")  # fmt: skip
    a("--attn_softmax_bf16", action="store_true", help="eager attention: softmax in bf16")
    a("--reuse_cache", action="store_true", help="accepted: polyfuse always reuses the KV cache")
    a("--trim_logits", action="store_true", help="accepted: polyfuse always runs the first token's head on one row")


def _output_options(p) -> None:
    g = p.add_argument_group("output and timing")
    a = g.add_argument
    a(
        "--warmup",
        type=int,
        default=3,
        metavar="N",
        help="untimed runs first (graph capture and compilation happen here)",
    )
    a("--n_iterations", type=int, default=5, metavar="N", help="timed runs")
    a("--output_dir", default=None, metavar="DIR",
      help="write results.json there (results-2.json, ... when taken): outputs, Stats, model, device, flags, "
      "versions")  # fmt: skip
    a("--print_new_text_only", action="store_true", help="print and save only the generated text")
    a("--stream", action="store_true", help="print the first run's text as it is generated (--batch_size 1)")
    a("--quiet", action="store_true",
      help="no progress bars (they show on a terminal only; the generation bar reads each token back)")  # fmt: skip
    a("--log_level", default="warning", choices=["debug", "info", "warning", "error", "critical"], metavar="LEVEL",
      help="debug, info, warning, error or critical: polyfuse's and transformers' log level")  # fmt: skip


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
    "regional_compile",  # optimum-habana's, polyfuse/cli/habana_options.py
    "force_static_compile",
    "bucket_size",
    "reuse_cache",
    "trim_logits",
)
