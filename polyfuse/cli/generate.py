"""``polyfuse-generate`` / examples/run_generation.py: load, warm up, time, print outputs and a Stats block.

The inputs (cli/inputs.py), the result files (cli/results.py), the Stats (cli/stats.py) and the progress bars
(cli/progress.py) live beside this file; here: the device, the checkpoint and its loading, and the runs."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import re
import sys
import threading
import time

import torch

from polyfuse.cli import results as output
from polyfuse.cli.args import FLAG_NAMES, DefaultSteps, build_parser
from polyfuse.cli.batch_run import generate_batch, input_device
from polyfuse.cli.errors import Interrupted, UsageError
from polyfuse.cli.inputs import (
    DEFAULT_PROMPT,
    check_prompts,
    encode,
    read_inputs,
    read_text,
    render_inputs,
    row_groups,
)
from polyfuse.cli.kernel_options import kernel_flags
from polyfuse.cli.progress import counter
from polyfuse.cli.stats import compile_note, print_report, summarize
from polyfuse.core import settings
from polyfuse.distributed.context import world_size_from_env
from polyfuse.distributed.launch import distributed_entry


__all__ = ["DEFAULT_PROMPT", "UsageError", "check_prompts", "main", "read_inputs", "read_text", "render_inputs"]
logger = logging.getLogger("polyfuse")
# A --model_name_or_path that is no local path but looks like this is a Hugging Face Hub id (org/name).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Any of these in a checkpoint folder means it has a tokenizer (save_pretrained writes none of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
# Default --bucket_size off Gaudi: KV lengths in steps of BUCKET_STEP, widened so that the decode of
# --max_new_tokens spans at most MAX_BUCKETS of them (each bucket is one CUDA graph capture).
BUCKET_STEP, MAX_BUCKETS = 128, 32
# A tqdm bar shows while the weights load when the checkpoint's files are at least this big (and stderr is a tty).
PROGRESS_MIN_BYTES = 1 << 30


def pick_device(name: str) -> torch.device:
    from polyfuse.core.platform import default_device_type, hpu_available

    if name == "auto":
        return torch.device(default_device_type())
    if name == "hpu" and not hpu_available():
        raise UsageError("--device hpu: no Gaudi found (habana_frameworks is not installed or sees no HPU)")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to torch")
    return torch.device(name)


def validate(args) -> None:
    for name in ("batch_size", "max_new_tokens", "n_iterations"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.temperature > 0 and not args.do_sample:  # optimum-habana's README gives --temperature 0 to greedy
        print(f"warning: --temperature {args.temperature} changes nothing without --do_sample (greedy)",
              file=sys.stderr)  # fmt: skip
        args.temperature = 1.0
    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        raise UsageError(f"--top_k must be >= 0, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1], got {args.top_p}")
    if getattr(args, "bf16", False) and getattr(args, "dtype", None) not in (None, "bfloat16"):
        raise UsageError(f"--bf16 and --dtype {args.dtype}: give one of them (--bf16 is --dtype bfloat16)")
    if getattr(args, "quant_calibration", None):
        from polyfuse.quant.gptq import GPTQ_FORMATS

        if args.quant not in GPTQ_FORMATS:
            raise UsageError(f"--quant_calibration: GPTQ needs --quant {', '.join(GPTQ_FORMATS[:-1])} or "
                             f"{GPTQ_FORMATS[-1]}")  # fmt: skip
    norms, scales = getattr(args, "quant_tune_norms", None), getattr(args, "quant_tune_scales", None)
    for flag, steps in (("--quant_tune_norms", norms), ("--quant_tune_scales", scales)):
        if steps is None:
            continue
        if steps < 1:
            raise UsageError(f"{flag}: STEPS must be >= 1, got {steps}")
        if world_size_from_env() > 1:
            raise UsageError(f"{flag}: tuning runs on one device, not under torchrun's tensor parallelism (tune and "
                             "save_pretrained on one device, then load that checkpoint sharded)")  # fmt: skip
        if not getattr(args, "quant_calibration", None):
            raise UsageError(f"{flag}: give --quant_calibration TEXT_FILE (the model is fitted to the float model on "
                             "that text)")  # fmt: skip
    if len({s for s in (norms, scales) if s is not None and not isinstance(s, DefaultSteps)}) > 1:
        raise UsageError(f"--quant_tune_norms {norms} and --quant_tune_scales {scales}: the norms and scales are "
                         "tuned together, in one set of steps; give STEPS to one of them")  # fmt: skip


def run_dtype(args) -> torch.dtype:
    """--dtype, or --bf16 (optimum-habana's flag), else float32."""
    name = getattr(args, "dtype", None) or ("bfloat16" if args.bf16 else "float32")
    return getattr(torch, name)


def default_bucket_size(device_type: str, max_new_tokens: int) -> int:
    """--bucket_size when not given. Gaudi keeps optimum-habana's -1 (one static shape: every new KV length is a
    graph compilation there). Elsewhere each decode step attends the cache up to its own position rounded up to
    BUCKET_STEP (widened to keep at most MAX_BUCKETS buckets), not the whole prompt + max_new_tokens: an answer that
    stops early no longer pays for the unused cache."""
    if device_type == "hpu":
        return -1
    return BUCKET_STEP * max(1, -(-max_new_tokens // (BUCKET_STEP * MAX_BUCKETS)))


def hub_snapshot(repo_id: str, token, gguf_file=None, weights: bool = True) -> str:
    """Folder of a Hugging Face Hub model: downloaded (config, tokenizer, safetensors or the one GGUF), or taken from
    huggingface_hub's cache when offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt"]
    if weights:
        patterns.append(gguf_file if gguf_file else "*.safetensors")
    hint = (
        f'download it first with `hf download {repo_id} --include "*.json" "*.safetensors" "tokenizer*"` '
        "(huggingface-cli download with older huggingface_hub)"
    )
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, token=token)
    except GatedRepoError:
        raise UsageError(
            f"{repo_id}: a gated Hugging Face Hub model: accept its license on huggingface.co, then pass --token or "
            "run `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise UsageError(
            f"{repo_id}: no such local folder, and no such model on the Hugging Face Hub (a private one needs --token)"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise UsageError(
            f"{repo_id}: no such local folder; as a Hugging Face Hub id it is not in the local cache and {why}: {hint}"
        ) from None
    except Exception as e:  # HTTP errors, disk full, ...: one line either way
        raise UsageError(
            f"{repo_id}: download from the Hugging Face Hub failed ({type(e).__name__}: {e}); {hint}"
        ) from None


def resolve_checkpoint(args) -> tuple[str, str | None]:
    """(folder, GGUF file or None) to load: the built-in model, a local folder (a folder holding exactly one .gguf
    and no config.json is that GGUF), a .gguf file, or a Hub id (org/name) that is no local path."""
    from polyfuse.models.builtin import builtin_model

    path, gguf = args.model_name_or_path, args.gguf_file
    hub = path is not None and not os.path.exists(path) and bool(HUB_ID.match(path))
    tok = args.tokenizer
    if args.token and not hub and not (tok and not os.path.exists(tok) and HUB_ID.match(tok)):
        print("warning: --token ignored: no Hugging Face Hub id to download", file=sys.stderr)
    if args.trust_remote_code:
        print(
            "warning: --trust_remote_code ignored: polyfuse runs its own model code, never code from a checkpoint",
            file=sys.stderr,
        )
    if path is None and gguf is None:
        return builtin_model()
    if path is None:
        return os.path.dirname(os.path.abspath(gguf)), gguf
    if hub:
        return hub_snapshot(path, args.token, gguf), gguf
    if gguf is None and os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if gguf is None and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        if len(ggufs) > 1:
            names = ", ".join(ggufs[:3]) + (", ..." if len(ggufs) > 3 else "")
            raise UsageError(f"{path} holds {len(ggufs)} GGUF files ({names}): pick one with --gguf_file")
    return path, gguf


def resolvable(args, path: str) -> bool:
    """Whether PATH would load as --model_name_or_path: a local path, or a Hub id in the cache (or downloadable)."""
    if os.path.exists(path):
        return True
    if not HUB_ID.match(path):
        return False
    try:
        hub_snapshot(path, args.token, weights=False)
    except UsageError:
        return False
    return True


def checkpoint_bytes(path: str, gguf: str | None) -> int:
    if gguf is not None:
        file = gguf if os.path.isabs(gguf) else os.path.join(path, gguf)
        return os.path.getsize(file) if os.path.isfile(file) else 0
    if not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def _stderr_is_tty() -> bool:
    return sys.stderr.isatty()


def bars_on(args) -> bool:
    """Progress bars: on a terminal, unless --quiet."""
    return not getattr(args, "quiet", False) and _stderr_is_tty()


@contextlib.contextmanager
def load_progress(nbytes: int, load_fn, quiet: bool = False):
    """Keyword arguments for ``load_fn`` (the model's from_pretrained): ``progress``, a callback drawing a tqdm bar
    (when tqdm is installed), when the checkpoint's files are PROGRESS_MIN_BYTES or more, stderr is a terminal (and
    no --quiet) and the loader takes the hook (``progress(nbytes, total_bytes)``, called as each tensor is copied);
    else nothing."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    hook = "progress" in inspect.signature(load_fn).parameters
    if tqdm is None or not hook or nbytes < PROGRESS_MIN_BYTES or quiet or not _stderr_is_tty():
        yield {}
        return
    bar, lock = None, threading.Lock()

    def progress(done: int, total: int) -> None:  # loader threads call it concurrently
        nonlocal bar
        with lock:
            if bar is None:
                bar = tqdm(
                    total=total, desc="Loading weights", unit="B", unit_scale=True, file=sys.stderr, leave=False,
                    mininterval=0, miniters=1,  # one refresh per tensor: a few hundred for an 8B checkpoint
                )  # fmt: skip
            bar.update(done)

    try:
        yield {"progress": progress}
    finally:
        if bar is not None:
            bar.close()


def load_cli_tokenizer(args, path: str, gguf: str | None):
    from polyfuse.checkpoint.tokenizer import load_tokenizer

    src = args.tokenizer
    if src is None and gguf is None and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise UsageError(
            f"{path} has no tokenizer (no tokenizer.json, tokenizer.model or tokenizer_config.json; save_pretrained "
            "writes none): pass --tokenizer with the original model's folder or Hub id, or copy its tokenizer in "
            f"with AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained({path!r})"
        )
    try:
        if src is None:
            tokenizer = load_tokenizer(path, gguf)
        elif src.endswith(".gguf") and os.path.isfile(src):
            tokenizer = load_tokenizer(os.path.dirname(os.path.abspath(src)), os.path.basename(src))
        else:
            if not os.path.exists(src) and HUB_ID.match(src):
                src = hub_snapshot(src, args.token, weights=False)
            tokenizer = load_tokenizer(src)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"{src or path}: cannot load a tokenizer ({type(e).__name__}: {e})") from None
    tokenizer.truncation_side = "left"  # --max_input_tokens keeps a prompt's end, where the question is
    return tokenizer


def draft_checkpoint(args, path: str):
    """--assistant_model PATH as --model_name_or_path is read: (folder, GGUF file or None, its tokenizer or None)."""
    where = argparse.Namespace(**{**vars(args), "model_name_or_path": path, "gguf_file": None, "tokenizer": None})
    folder, gguf = resolve_checkpoint(where)
    has_tokenizer = gguf is not None or any(os.path.exists(os.path.join(folder, f)) for f in TOKENIZER_FILES)
    return folder, gguf, load_cli_tokenizer(where, folder, gguf) if has_tokenizer else None


def load(args, device, flags):
    from polyfuse.models import AutoModelForCausalLM

    path, gguf = resolve_checkpoint(args)
    args._checkpoint = (path, gguf)  # what was loaded, for results.json
    dtype = run_dtype(args)
    calibration = getattr(args, "quant_calibration", None)
    tokenizer = windows = None
    if calibration:  # everything about the calibration is checked before the (float) model loads
        refuse_quantized_checkpoint(path, gguf)
        tokenizer = load_cli_tokenizer(args, path, gguf)
        windows = calibration_windows(calibration, tokenizer)
    # GPTQ starts from the float model; a PEFT adapter merges into float weights (a GGUF's are dequantized)
    peft = getattr(args, "peft_model", None)  # serve's parser has no adapter flag
    quant = "none" if calibration or peft else getattr(args, "quant", None)
    steps = tune_steps(args) if calibration else None
    tune = steps is not None  # the head is packed after it
    what = tuple(getattr(args, f, None) is not None for f in ("quant_tune_norms", "quant_tune_scales"))
    quiet = getattr(args, "quiet", False)
    with load_progress(checkpoint_bytes(path, gguf), AutoModelForCausalLM.from_pretrained, quiet) as progress:
        model = AutoModelForCausalLM.from_pretrained(
            path, gguf_file=gguf, dtype=dtype, device=device, flags=flags, overrides=args.ops, quant=quant,
            quant_lm_head=bool(gguf and getattr(args, "quant_lm_head", False) and not tune), **progress,
        )  # fmt: skip
    if peft:
        from polyfuse.cli.peft_adapter import merge_adapter

        model = merge_adapter(model, args.peft_model)
    if calibration:
        warn_few_calibration_tokens(model, windows, calibration)
        targets = float_targets(model, windows, tune_flag(*what)) if tune else None  # before the float weights go
        gptq_quantize(model, args.quant, windows, bars_on(args))
        if tune:
            tune_norms(model, windows, targets, steps, *what, bars=bars_on(args))
    if getattr(args, "quant_lm_head", False):
        from polyfuse.quant.quantize import LOAD_TIME_FORMATS, quantize_lm_head_

        quantize_lm_head_(model, args.quant if args.quant in LOAD_TIME_FORMATS else None)
    model.eval()
    return model, tokenizer if tokenizer is not None else load_cli_tokenizer(args, path, gguf)


def refuse_quantized_checkpoint(path: str, gguf) -> None:
    """GPTQ starts from float weights: a checkpoint whose config.json has a quantization_config (AutoGPTQ,
    compressed-tensors, polyfuse's own) is refused. A GGUF is dequantized first, as --quant does with it."""
    config = os.path.join(path, "config.json") if path and gguf is None else None
    if config and os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                quantized = "quantization_config" in json.load(f)
        except (OSError, ValueError):
            return  # loading reports an unreadable config in its own words
        if quantized:
            raise UsageError(f"--quant_calibration: {path} is already quantized; GPTQ needs float weights")


def calibration_windows(where: str, tokenizer) -> list:
    """--quant_calibration's token windows (quant/gptq.calibration_windows: 512 tokens, at most 64), read before the
    model is loaded: a bad file or an empty text fails fast."""
    from polyfuse.quant.gptq import calibration_windows as windows_of

    text = read_text(where, "--quant_calibration")
    windows = windows_of(torch.tensor(tokenizer(text, add_special_tokens=False).input_ids))
    if sum(len(w) for w in windows) < 2:
        raise UsageError(f"--quant_calibration {where}: the text has too few tokens")
    return windows


def warn_few_calibration_tokens(model, windows: list, where: str) -> None:
    """One warning when the calibration text has fewer tokens than the widest projection has inputs: each
    projection's input Hessian (K x K, a sum over the tokens) is then rank-deficient, and GPTQ fits the calibration
    tokens at the cost of other text (the built-in model on 3 KB of text answered worse than round to nearest)."""
    from polyfuse.quant.gptq import CALIBRATION_WINDOW, CALIBRATION_WINDOWS

    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", 0) * (getattr(cfg, "head_dim", None) or 0)
    need = max(cfg.hidden_size, getattr(cfg, "intermediate_size", 0) or 0, heads)
    tokens = sum(int(w.numel()) for w in windows)
    if tokens < need:
        print(f"warning: --quant_calibration {where}: {tokens} tokens, fewer than the {need} inputs of the model's "
              "widest projection: GPTQ's input statistics are rank-deficient and its answers may be worse than round "
              f"to nearest; give at least {need} tokens of text like what the model will serve (up to "
              f"{CALIBRATION_WINDOW * CALIBRATION_WINDOWS} are used)", file=sys.stderr)  # fmt: skip


def gptq_quantize(model, fmt: str, windows: list, bars: bool = False) -> None:
    """quantize_model_ with GPTQ (a bar over the decoder layers on a terminal); a Hessian that cannot be factored
    or memory that runs out is one error line."""
    from polyfuse.quant.quantize import quantize_model_

    bar = counter(bars, f"GPTQ {fmt}", "layer")
    try:
        quantize_model_(model, fmt, windows, progress=bar)
    except torch.linalg.LinAlgError as e:
        raise UsageError(f"--quant_calibration: GPTQ could not factor a projection's input Hessian ({e}); the "
                         "calibration text's activations may hold inf/NaN (try without --bf16)") from None  # fmt: skip
    except torch.OutOfMemoryError:
        raise UsageError("--quant_calibration: out of memory during GPTQ: one decoder layer's K x K float32 input "
                         "Hessians are held at once beside the float model (Llama-3-8B: about 1 GB; 70B: about 4 "
                         "GB)") from None  # fmt: skip
    finally:
        if bar is not None:
            bar.close()


def tune_steps(args):
    """The steps of --quant_tune_norms / --quant_tune_scales (with both, the one given STEPS), or None."""
    flags = (getattr(args, "quant_tune_norms", None), getattr(args, "quant_tune_scales", None))
    given = [s for s in flags if s is not None]
    return min(given, key=lambda s: isinstance(s, DefaultSteps)) if given else None


def tune_flag(norms: bool, scales: bool) -> str:
    """The flag(s) a tuning's messages name."""
    return "/".join(f for f, on in (("--quant_tune_norms", norms), ("--quant_tune_scales", scales)) if on)


def float_targets(model, windows: list, flag: str = "--quant_tune_norms") -> list:
    """The tuning's targets: the float model's final-norm outputs on the calibration windows."""
    from polyfuse.quant.tuning import norm_targets

    try:
        return norm_targets(model, windows)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    except torch.OutOfMemoryError:
        raise UsageError(f"{flag}: out of memory keeping the float model's final hidden states on the calibration "
                         "text (windows x 512 x hidden size); give a shorter --quant_calibration text"
                         ) from None  # fmt: skip


def tune_norms(model, windows: list, targets: list, steps: int, norms: bool = True, scales: bool = False,
               bars: bool = False) -> None:  # fmt: skip
    """--quant_tune_norms / --quant_tune_scales: the quantized model's norms and / or scales fitted to ``targets``
    (a bar over the steps on a terminal, moved after each pass over the windows); what moved and the KL before and
    after on stderr (when nothing was kept, tune_norms_'s warning alone)."""
    from polyfuse.quant.tuning import split_windows, tune_norms_, tuned_norm_count, tuned_scale_count

    flag = tune_flag(norms, scales)
    bar = counter(bars, "Tuning", "step")
    per_pass = len(split_windows(len(windows))[0])
    log = (lambda passes, *_: bar(min(passes * per_pass, steps), steps)) if bar is not None else None
    try:
        kl = tune_norms_(model, windows, targets, steps, norms=norms, scales=scales, log=log)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    except torch.OutOfMemoryError:
        raise UsageError(f"{flag}: out of memory in the backward through the quantized model (one window of 512 "
                         "tokens, one decoder layer's dequantized weights)") from None  # fmt: skip
    finally:
        if bar is not None:
            bar.close()
    if not kl["tuned"]:
        return  # tune_norms_'s one warning line said that no pass lowered the KL and that nothing moved
    counts = ((tuned_norm_count(model), "norm weights", norms), (tuned_scale_count(model), "scales", scales))
    what = " and ".join(f"{n} {kind}" for n, kind, on in counts if on)
    where = f"{kl['held_out']} held-out calibration window(s)" if kl["held_out"] else "the calibration window"
    print(f"{flag}: {what} fitted in {steps} steps; KL to the float model on {where} {kl['before']:.4f} -> "
          f"{kl['after']:.4f} per token", file=sys.stderr)  # fmt: skip


def run_arguments(args) -> dict:
    """This run's arguments for results.json (as resolved: device defaults and the checkpoint filled in), without
    the token."""
    out = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    if out.get("token"):
        out["token"] = "<hidden>"
    path, gguf = getattr(args, "_checkpoint", (None, None))
    out["model_name_or_path"] = args.model_name_or_path or path
    out["gguf_file"] = args.gguf_file or gguf
    return out


def model_source(args) -> dict:
    """The model as results.json names it: the built-in's name, or the path or Hub id given, and what was read."""
    from polyfuse.models.builtin import BUILTIN_NAME

    path, gguf = getattr(args, "_checkpoint", (None, None))
    name = args.model_name_or_path or (f"{BUILTIN_NAME} (built-in)" if args.gguf_file is None else args.gguf_file)
    return {"name": name, "path": path, "gguf_file": gguf}


def op_overrides(args) -> str:
    """The op overrides in force, as the Stats and results.json name them: --ops, then POLYFUSE_OPS."""
    from polyfuse.core.registry import ENV_OVERRIDES

    given = [(args.ops, "--ops"), (settings.get(ENV_OVERRIDES), ENV_OVERRIDES)]
    return "; ".join(f"{text} ({where})" for text, where in given if text)


def _dynamo_graphs() -> int:
    """torch.compile graphs compiled so far in this process (dynamo's counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


class FirstLogits:
    """Keeps a copy of the model's first last-position logits (the cached step's head, or the full forward's LM
    head without --use_kv_cache); ``check()`` after that run raises one error line when they hold NaN or Inf. The
    weights were checked when loaded, so such logits come from the computation (an overflow in float16, say)."""

    def __init__(self, model):
        self.model, self.logits, self.handle = model, None, None
        head = model.head_logits

        def head_logits(h):
            out = head(h)
            self.keep(out)
            return out

        model.head_logits = head_logits
        self.handle = model.lm_head.register_forward_hook(lambda m, args, out: self.keep(out))

    def keep(self, logits) -> None:
        if self.logits is None and isinstance(logits, torch.Tensor):
            self.logits = (logits[:, -1] if logits.dim() == 3 else logits).detach().clone()
        self.remove()

    def remove(self) -> None:
        self.model.__dict__.pop("head_logits", None)
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def check(self, dtype: torch.dtype) -> None:
        self.remove()
        if self.logits is None or bool(torch.isfinite(self.logits).all()):
            return
        rows = [str(i + 1) for i, ok in enumerate(torch.isfinite(self.logits).all(-1).tolist()) if not ok]
        hint = "try --dtype bfloat16 or float32" if dtype == torch.float16 else "check the checkpoint's config"
        raise UsageError(f"the first logits hold NaN or Inf (row {', '.join(rows)} of the first batch) although the "
                         f"weights are finite: the forward overflowed in {str(dtype)[6:]}; {hint}")  # fmt: skip


class Runs:
    """The warm-up and timed runs, each over every batch of the inputs. Ctrl-C stops them and keeps what finished:
    the last finished run's outputs and the finished timed runs' timings."""

    def __init__(self, args, model, tokenizer, texts: list[str], groups: list[list[int]], device):
        self.args, self.model, self.tokenizer, self.texts, self.groups = args, model, tokenizer, texts, groups
        self.device = device
        self.gen = model.runtime.sampling_generator(args.seed)  # HPU: None, its default generator seeded
        self.last = None  # [(rows, ids, out)] per batch of the last finished run
        self.timed: list[list[dict]] = []
        self.warmup_s, self.graphs, self.interrupted = None, None, False
        self.speculative = None  # the last run's speculative-decoding counts, where it speculated
        self.first_logits = FirstLogits(model)
        self.bars = bars_on(args)

    def one(self, size=None) -> list[dict]:
        """One run over every batch; ``size`` (--simulate_dyn_prompt): each batch's prompt columns cut or stretched
        to that many first (cli/dyn_prompt.py)."""
        from polyfuse.cli.dyn_prompt import adjust_batch

        args, outs, times = self.args, [], []
        for rows in self.groups:
            t0 = time.perf_counter()
            ids, mask = encode(args, self.tokenizer, [self.texts[i] for i in rows], input_device(args, self.device))
            if size is not None:
                ids, mask = adjust_batch(ids, mask, size)
            out, timings, speculative = generate_batch(args, self.model, self.tokenizer, ids, mask, self.gen,
                                                       self.bars)  # fmt: skip
            self.speculative = speculative or self.speculative
            self.first_logits.check(self.model.dtype)
            outs.append((rows, ids, out))
            times.append(dict(first_s=timings["first_token_s"], rest_s=timings["rest_s"], rows=out.shape[0],
                              new_tokens=timings["new_tokens"], e2e_s=time.perf_counter() - t0))  # fmt: skip
        self.last = outs
        return times

    def go(self) -> None:
        from polyfuse.cli.dyn_prompt import timed_lengths, warmup_plan  # --simulate_dyn_prompt

        args, runtime, lengths = self.args, self.model.runtime, self.args.simulate_dyn_prompt
        try:
            t0, graphs = time.perf_counter(), _dynamo_graphs()
            for line, size in warmup_plan(lengths, args.warmup, args.bucket_size):
                print(line, flush=True)
                self.one(size)
            runtime.synchronize()
            self.warmup_s, self.graphs = time.perf_counter() - t0, _dynamo_graphs() - graphs
            runtime.reset_peak_memory()
            for i, size in enumerate(timed_lengths(lengths, args.n_iterations)):
                if size is not None:
                    print(f"Generating for shape, {size}", flush=True)
                self.timed.append(self.one(size))
                print(iteration_line(i + 1, args.n_iterations, self.timed[-1]), flush=True)
        except KeyboardInterrupt:
            self.interrupted = True


def iteration_line(i: int, n: int, batches: list[dict]) -> str:
    first = 1e3 * sum(b["first_s"] for b in batches) / len(batches)
    rest = [b["rest_s"] / (b["new_tokens"] - 1) for b in batches if b["new_tokens"] > 1]
    rest_text = f"{1e3 * sum(rest) / len(rest):.2f} ms/token" if rest else "n/a (no token after the first)"
    where = f" ({len(batches)} batches)" if len(batches) > 1 else ""
    e2e = 1e3 * sum(b["e2e_s"] for b in batches)
    return f"Iteration {i}/{n}{where}: first token {first:.2f} ms, rest {rest_text}, end to end {e2e:.2f} ms"


def warn_chat_model(args, tokenizer, runs: Runs) -> None:
    """A chat model asked without its template often answers EOS at once: one warning saying how to ask it (with
    --ignore_eos, optimum-habana's default, generation goes on past that EOS)."""
    eos = tokenizer.eos_token_id
    if args.use_chat_template or eos is None or not getattr(tokenizer, "chat_template", None):
        return
    if all(out.shape[1] > ids.shape[1] and bool((out[:, ids.shape[1]] == eos).all()) for _, ids, out in runs.last):
        what = ("began with EOS (generation went on past it: --ignore_eos is optimum-habana's default)"
                if args.ignore_eos else "ended at its first token (EOS)")  # fmt: skip
        print(f"warning: every output {what}: this is a chat model (its tokenizer has a chat template); add "
              "--use_chat_template (or give --chat_file) to ask it in that form", file=sys.stderr)  # fmt: skip


def collect(args, runs: Runs, used: list[str], device, flags: dict) -> dict:
    """results.json's contents: the Stats of the finished timed runs, the last finished run's outputs, the model,
    device, flags and versions."""
    model, tokenizer = runs.model, runs.tokenizer
    outputs = []
    for _, ids, out in runs.last:
        outputs += tokenizer.batch_decode(out[:, ids.shape[1] :] if args.print_new_text_only else out,
                                          skip_special_tokens=True)  # fmt: skip
    stats = summarize(runs.timed, args.max_new_tokens)
    note = compile_note(flags, device.type, args.warmup, runs.graphs)
    if runs.warmup_s is None:
        note = "interrupted during the warm-up"
    stats["notes"]["graph_compilation_duration"] = note
    info = output.run_info(model, device, flags, model_source(args))
    info["ops"] = op_overrides(args)
    return {
        **{k: v for k, v in stats.items() if k != "notes"},
        "graph_compilation_duration": runs.warmup_s if note is None else None,
        "warmup_duration": runs.warmup_s,
        "memory": model.runtime.memory_stats(),
        "input": [used[i] for group in runs.groups for i in group],  # as used: after truncation
        "output": outputs,
        "backends": model.kernels.as_dict(),
        "speculative": runs.speculative.as_dict() if runs.speculative is not None else None,
        **info,
        "timed_runs": len(runs.timed),
        "interrupted": runs.interrupted,
        "notes": {k: v for k, v in stats["notes"].items() if v},
        "args": run_arguments(args),
    }


def check_bucket_flags(args) -> None:
    """optimum-habana's asserts on --bucket_internal and --reduce_recompile, as one error line each."""
    if args.bucket_internal and (args.bucket_size < 0 or not args.use_kv_cache):
        raise UsageError(f"--bucket_internal buckets the KV cache: it needs --use_kv_cache and --bucket_size >= 0 "
                         f"(got {args.bucket_size}{'' if args.use_kv_cache else ', no --use_kv_cache'})")  # fmt: skip
    if args.reduce_recompile and args.bucket_size <= 0:
        raise UsageError(f"--reduce_recompile needs --bucket_size > 0, got {args.bucket_size} (as optimum-habana "
                         "asserts)")  # fmt: skip


def prepare_output_dir(args) -> None:
    """Check --output_dir before the model loads (creating it if missing), so a bad one never costs the run."""
    args._created_output_dir = output.prepare_output_dir(args.output_dir)


def run(args) -> dict:
    from polyfuse.core.flags import check_flags

    validate(args)
    from polyfuse.cli.habana_options import apply_habana_options  # optimum-habana's other flags

    for w in apply_habana_options(args):
        print(f"warning: {w}", file=sys.stderr)
    if args.dataset_name:
        from polyfuse.cli.dataset import read_dataset  # --dataset_name: prompts from a datasets data set

        inputs = read_dataset(args)
    else:
        inputs = read_inputs(args)
    if args.peft_model:
        from polyfuse.cli.peft_adapter import choose_base  # --peft_model: the adapter's base, as optimum-habana

        choose_base(args, lambda path: resolvable(args, path))
    device = pick_device(args.device)
    if args.flash_attention_fast_softmax is None:
        # optimum-habana's intent: fast softmax by default with Gaudi flash attention, an explicit value wins.
        args.flash_attention_fast_softmax = bool(args.use_flash_attention and device.type == "hpu")
    if args.bucket_size is None:
        args.bucket_size = default_bucket_size(device.type, args.max_new_tokens)
    check_bucket_flags(args)
    prepare_output_dir(args)
    flags = {name: getattr(args, name) for name in FLAG_NAMES} | kernel_flags(args)
    flags, warnings = check_flags(device.type, flags)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    from polyfuse.quant import inc  # QUANT_CONFIG: Intel Neural Compressor's fp8 flow, as optimum-habana runs it

    refused = inc.refusal(device.type, getattr(args, "quant", None))
    if refused:
        raise UsageError(refused)
    torch.manual_seed(args.seed)
    model, tokenizer = load(args, device, flags)
    inc_run = inc.start(model)
    prepare_generation(args, model, tokenizer, device, flags)
    if args.dataset_name:
        from polyfuse.cli.dataset import print_dataset_report, run_dataset

        runs, result = None, run_dataset(args, model, tokenizer, inputs, device, bars_on(args))
    else:
        runs = prompt_runs(args, model, tokenizer, inputs, device)
    done = inc.finish(inc_run, model)  # MEASURE: the measurement files are written here
    if done:
        print(done, file=sys.stderr)
    if runs is None:
        result = collect_dataset(args, result, model, device, flags)
        print_dataset_report(result)
    else:
        result = collect(args, runs, runs.used, device, flags)
        print_report(result, args)
    written = None
    if args.output_dir and (settings.get("RANK") or 0) == 0:  # under torchrun rank 0 writes for every rank
        written = output.write_results(args.output_dir, result)
        print(f"Results written to {written}")
    if runs is not None and runs.interrupted:
        kept = f"results in {written}" if written else "nothing written (no --output_dir)"
        raise Interrupted(f"interrupted: {len(runs.timed)} of {args.n_iterations} timed runs finished; {kept}")
    return result


def prepare_generation(args, model, tokenizer, device, flags) -> None:
    """What generate() takes besides the prompts, made once the model and tokenizer are there: --bad_words' ids,
    the speculative-decoding setup; --print_backends' report."""
    from polyfuse.cli.generation_options import bad_words_ids
    from polyfuse.cli.speculative_setup import prepare_speculation  # --assistant_model, --speculative_model, ...

    args._polyfuse_bad_words = bad_words_ids(tokenizer, args.bad_words)
    speculation = prepare_speculation(args, model, tokenizer, device, flags, lambda path: draft_checkpoint(args, path))
    if args.print_backends:
        from polyfuse.quant.report import report as quantization_report  # --quant: formats and their kernels

        ops = op_overrides(args)
        print("\n".join(filter(None, [model.kernels.report(), ops and f"op overrides: {ops}",
                                      quantization_report(model), speculation])))  # fmt: skip


def prompt_runs(args, model, tokenizer, inputs: list, device) -> "Runs":
    """The warm-up and timed runs over --prompt / --prompt_file / --chat_file's inputs."""
    texts, used = check_prompts(args, tokenizer, render_inputs(args, tokenizer, inputs))
    runs = Runs(args, model, tokenizer, texts, row_groups(len(texts), args.batch_size), device)
    runs.used = used
    runs.go()
    if runs.last is None:
        raise Interrupted("interrupted before any run finished: nothing written")
    warn_chat_model(args, tokenizer, runs)
    return runs


def collect_dataset(args, r: dict, model, device, flags: dict) -> dict:
    """results.json's contents for a --dataset_name run: its numbers and texts, the model, device, flags, versions."""
    info = output.run_info(model, device, flags, model_source(args))
    info["ops"] = op_overrides(args)
    return {**r, "backends": model.kernels.as_dict(), **info, "args": run_arguments(args)}


def set_log_level(name: str) -> None:
    from transformers.utils import logging as hf_logging

    level = getattr(logging, name.upper())
    logging.basicConfig(level=level, format="%(message)s")
    logger.setLevel(level)
    hf_logging.set_verbosity(level)


@distributed_entry  # under torchrun: tensor parallel over its world, rank 0 prints (docs/distributed.md)
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    set_log_level(args.log_level)
    from polyfuse.core.errors import CheckpointError, one_line

    try:
        run(args)
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    except (UsageError, CheckpointError, ValueError, FileNotFoundError) as e:
        print("error: " + one_line(e), file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError:
        print("error: out of GPU memory; lower --batch_size or --max_new_tokens", file=sys.stderr)
        return 1
    finally:
        output.remove_if_empty(args.output_dir, getattr(args, "_created_output_dir", False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
