"""``polyfuse-generate`` / examples/run_generation.py: load, warm up, time, print outputs and a Stats block."""

from __future__ import annotations

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

from polyfuse.cli.args import FLAG_NAMES, DefaultSteps, build_parser
from polyfuse.distributed.context import world_size_from_env
from polyfuse.distributed.launch import distributed_entry


DEFAULT_PROMPT = "DeepSpeed is a machine learning framework"
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


class UsageError(Exception):
    """Bad input the user can fix; printed as one line, exit code 2."""


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
    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        raise UsageError(f"--top_k must be >= 0, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1], got {args.top_p}")
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


def default_bucket_size(device_type: str, max_new_tokens: int) -> int:
    """--bucket_size when not given. Gaudi keeps optimum-habana's -1 (one static shape: every new KV length is a
    graph compilation there). Elsewhere each decode step attends the cache up to its own position rounded up to
    BUCKET_STEP (widened to keep at most MAX_BUCKETS buckets), not the whole prompt + max_new_tokens: an answer that
    stops early no longer pays for the unused cache."""
    if device_type == "hpu":
        return -1
    return BUCKET_STEP * max(1, -(-max_new_tokens // (BUCKET_STEP * MAX_BUCKETS)))


def read_inputs(args) -> list:
    """The distinct inputs, each a prompt string or a message list (--chat_file), read and checked before anything
    loads. --chat_file and --system_prompt turn --use_chat_template on."""
    if args.chat_file is None:
        if args.system_prompt is not None:
            args.use_chat_template = True
        return list(args.prompt or [DEFAULT_PROMPT])
    where = f"--chat_file {args.chat_file}"
    if args.prompt:
        raise UsageError(f"{where} and --prompt: give one of them (end the conversation with the user's question)")
    try:
        with open(args.chat_file, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{where}: not valid UTF-8 JSON ({e})") from None
    except OSError as e:
        raise UsageError(f"{where}: cannot read it ({e.strerror or e})") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if isinstance(data, list) and data and all(isinstance(m, dict) for m in data):
        data = [data]  # one conversation
    shape = '[{"role": ..., "content": ...}, ...] or a list of such conversations'
    if not isinstance(data, list) or not data or not all(isinstance(c, list) and c for c in data):
        raise UsageError(f"{where}: expected {shape}")
    for i, conv in enumerate(data, 1):
        for m in conv:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise UsageError(f"{where}: conversation {i} has a message that is not {{role: str, content: str}}")
        if conv[-1]["role"] == "assistant":
            raise UsageError(
                f"{where}: conversation {i} ends with an assistant message; end it with the user's turn to answer"
            )
    args.use_chat_template = True
    return data


def prepare_output_dir(args) -> None:
    """Check --output_dir before the model loads (creating it if missing), so a bad one never costs the run."""
    path = args.output_dir
    if path is None:
        return
    where = f"--output_dir {path}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{where}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{where}: cannot create it ({e.strerror or e})") from None
    if os.path.isdir(os.path.join(path, "results.json")):
        raise UsageError(f"{where}: results.json there is a folder")
    probe = os.path.join(path, f".results.json.{os.getpid()}.probe")
    try:
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"{where}: cannot write there ({e.strerror or e})") from None


def write_results(path: str, result: dict) -> str:
    """results.json written atomically: a temporary file in the same folder, then renamed over the old one. UTF-8,
    non-ASCII text as is."""
    target = os.path.join(path, "results.json")
    tmp = os.path.join(path, f".results.json.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, ensure_ascii=False, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise UsageError(f"--output_dir {path}: writing results.json failed ({e.strerror or e})") from None
        raise
    return target


def run_arguments(args) -> dict:
    """This run's arguments for results.json (as resolved: device defaults filled in), without the token."""
    out = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    if out.get("token"):
        out["token"] = "<hidden>"
    return out


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
    and no config.json is that GGUF), or a Hub id (org/name) that is no local path."""
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
    if gguf is None and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        if len(ggufs) > 1:
            names = ", ".join(ggufs[:3]) + (", ..." if len(ggufs) > 3 else "")
            raise UsageError(f"{path} holds {len(ggufs)} GGUF files ({names}): pick one with --gguf_file")
    return path, gguf


def checkpoint_bytes(path: str, gguf: str | None) -> int:
    if gguf is not None:
        file = gguf if os.path.isabs(gguf) else os.path.join(path, gguf)
        return os.path.getsize(file) if os.path.isfile(file) else 0
    if not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def _stderr_is_tty() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def load_progress(nbytes: int, load_fn):
    """Keyword arguments for ``load_fn`` (the model's from_pretrained): ``progress``, a callback drawing a tqdm bar
    (when tqdm is installed), when the checkpoint's files are PROGRESS_MIN_BYTES or more, stderr is a terminal and
    the loader takes the hook (``progress(nbytes, total_bytes)``, called as each tensor is copied); else nothing."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    hook = "progress" in inspect.signature(load_fn).parameters
    if tqdm is None or not hook or nbytes < PROGRESS_MIN_BYTES or not _stderr_is_tty():
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


def load(args, device, flags):
    from polyfuse.models import AutoModelForCausalLM

    path, gguf = resolve_checkpoint(args)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    calibration = getattr(args, "quant_calibration", None)
    tokenizer = windows = None
    if calibration:  # everything about the calibration is checked before the (float) model loads
        refuse_quantized_checkpoint(path, gguf)
        tokenizer = load_cli_tokenizer(args, path, gguf)
        windows = calibration_windows(calibration, tokenizer)
    quant = "none" if calibration else getattr(args, "quant", None)  # GPTQ starts from the float model
    steps = tune_steps(args) if calibration else None
    tune = steps is not None  # the head is packed after it
    what = tuple(getattr(args, f, None) is not None for f in ("quant_tune_norms", "quant_tune_scales"))
    with load_progress(checkpoint_bytes(path, gguf), AutoModelForCausalLM.from_pretrained) as progress:
        model = AutoModelForCausalLM.from_pretrained(
            path, gguf_file=gguf, dtype=dtype, device=device, flags=flags, overrides=args.ops, quant=quant,
            quant_lm_head=bool(gguf and getattr(args, "quant_lm_head", False) and not tune), **progress,
        )  # fmt: skip
    if calibration:
        targets = float_targets(model, windows, tune_flag(*what)) if tune else None  # before the float weights go
        gptq_quantize(model, args.quant, windows)
        if tune:
            tune_norms(model, windows, targets, steps, *what)
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


def read_text(path: str, flag: str) -> str:
    """A UTF-8 text file's contents, or one UsageError line naming ``flag`` and what is wrong with the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{flag} {path}: a folder, not a text file") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


def calibration_windows(where: str, tokenizer) -> list:
    """--quant_calibration's token windows (quant/gptq.calibration_windows: 512 tokens, at most 64), read before the
    model is loaded: a bad file or an empty text fails fast."""
    from polyfuse.quant.gptq import calibration_windows as windows_of

    text = read_text(where, "--quant_calibration")
    windows = windows_of(torch.tensor(tokenizer(text, add_special_tokens=False).input_ids))
    if sum(len(w) for w in windows) < 2:
        raise UsageError(f"--quant_calibration {where}: the text has too few tokens")
    return windows


def gptq_quantize(model, fmt: str, windows: list) -> None:
    """quantize_model_ with GPTQ; a Hessian that cannot be factored or memory that runs out is one error line."""
    from polyfuse.quant.quantize import quantize_model_

    try:
        quantize_model_(model, fmt, windows)
    except torch.linalg.LinAlgError as e:
        raise UsageError(f"--quant_calibration: GPTQ could not factor a projection's input Hessian ({e}); the "
                         "calibration text's activations may hold inf/NaN (try without --bf16)") from None  # fmt: skip
    except torch.OutOfMemoryError:
        raise UsageError("--quant_calibration: out of memory during GPTQ: one decoder layer's K x K float32 input "
                         "Hessians are held at once beside the float model (Llama-3-8B: about 1 GB; 70B: about 4 "
                         "GB)") from None  # fmt: skip


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


def tune_norms(model, windows: list, targets: list, steps: int, norms: bool = True, scales: bool = False) -> None:
    """--quant_tune_norms / --quant_tune_scales: the quantized model's norms and / or scales fitted to ``targets``;
    what moved and the KL before and after on stderr (when nothing was kept, tune_norms_'s warning alone)."""
    from polyfuse.quant.tuning import tune_norms_, tuned_norm_count, tuned_scale_count

    flag = tune_flag(norms, scales)
    try:
        kl = tune_norms_(model, windows, targets, steps, norms=norms, scales=scales)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    except torch.OutOfMemoryError:
        raise UsageError(f"{flag}: out of memory in the backward through the quantized model (one window of 512 "
                         "tokens, one decoder layer's dequantized weights)") from None  # fmt: skip
    if not kl["tuned"]:
        return  # tune_norms_'s one warning line said that no pass lowered the KL and that nothing moved
    counts = ((tuned_norm_count(model), "norm weights", norms), (tuned_scale_count(model), "scales", scales))
    what = " and ".join(f"{n} {kind}" for n, kind, on in counts if on)
    where = f"{kl['held_out']} held-out calibration window(s)" if kl["held_out"] else "the calibration window"
    print(f"{flag}: {what} fitted in {steps} steps; KL to the float model on {where} {kl['before']:.4f} -> "
          f"{kl['after']:.4f} per token", file=sys.stderr)  # fmt: skip


def render_inputs(args, tokenizer, inputs: list) -> list[str]:
    """Each distinct input as the text that is tokenized: the prompt, or its chat template rendering."""
    if not args.use_chat_template:
        return list(inputs)
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("--use_chat_template: this tokenizer has no chat template")
    texts, kept_own = [], []
    for i, item in enumerate(inputs, 1):
        messages = list(item) if isinstance(item, list) else [{"role": "user", "content": item}]
        if args.system_prompt is not None:
            if messages[0]["role"] == "system":
                kept_own.append(str(i))
            else:
                messages.insert(0, {"role": "system", "content": args.system_prompt})
        try:
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        except Exception as e:
            raise UsageError(f"the tokenizer's chat template rejects input {i} ({type(e).__name__}: {e})") from None
    if kept_own:
        print(
            f"warning: --system_prompt ignored for conversation {', '.join(kept_own)} of --chat_file, which has its "
            "own system message",
            file=sys.stderr,
        )
    return texts


def check_prompts(args, tokenizer, texts: list[str]) -> tuple[list[str], list[str]]:
    """(texts to tokenize, texts as they are used, for the report), once before the runs. An empty prompt alone is
    an error; in a batch it warns and starts from the BOS token, as transformers' text-generation pipeline starts an
    empty prompt. Prompts longer than --max_input_tokens are truncated from the left, with one warning."""
    special = not args.use_chat_template
    texts = list(texts)[: args.batch_size]  # rows cycle through the inputs; later ones are not used
    lengths = [len(tokenizer(t, add_special_tokens=special).input_ids) for t in texts]
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty and len(empty) == len(texts):
        which = "--prompt is" if len(texts) == 1 else "every --prompt is"
        raise UsageError(f"{which} empty: there is nothing to generate from; give it some text")
    if empty:
        rows = [str(r + 1) for r in range(args.batch_size) if r % len(texts) in empty]
        if tokenizer.bos_token is None:
            raise UsageError(
                f"--prompt {', '.join(str(i + 1) for i in empty)} is empty and this tokenizer has no BOS token to "
                "start it from: give it some text"
            )
        else:
            print(
                f"warning: --prompt {', '.join(str(i + 1) for i in empty)} is empty (input {', '.join(rows)} of "
                f"{args.batch_size}): generated from the BOS token {tokenizer.bos_token!r} alone, as transformers' "
                "text-generation pipeline does",
                file=sys.stderr,
            )
            for i in empty:
                texts[i] = tokenizer.bos_token
    used = list(texts)
    limit = args.max_input_tokens
    if limit > 0:
        budget = limit - (tokenizer.num_special_tokens_to_add() if special else 0)
        dropped = []
        for i, t in enumerate(texts):
            ids = tokenizer(t, add_special_tokens=False).input_ids
            if len(ids) > budget:
                dropped.append(f"{len(ids) - budget} tokens of prompt {i + 1}")
                used[i] = tokenizer.decode(ids[len(ids) - budget :]) if budget > 0 else ""
        if dropped:
            print(
                f"warning: --max_input_tokens {limit}: prompts truncated from the left (their last {limit} tokens "
                f"kept); dropped the first {', '.join(dropped)}",
                file=sys.stderr,
            )
    return texts, used


def encode(args, tokenizer, texts: list[str], device):
    """Token ids for one run (tokenization is part of the timed run, as in optimum-habana): ``texts`` cycled to fill
    --batch_size, left-padded; with --max_input_tokens > 0 padded / truncated (from the left) to that length."""
    prompts = [texts[i % len(texts)] for i in range(args.batch_size)]
    kw = {"return_tensors": "pt", "add_special_tokens": not args.use_chat_template}
    if args.max_input_tokens > 0:
        kw.update(padding="max_length", max_length=args.max_input_tokens, truncation=True)
    else:
        kw.update(padding=True)
    enc = tokenizer(prompts, **kw)
    return prompts, enc.input_ids.to(device), enc.attention_mask.to(device)


def run(args) -> dict:
    from polyfuse.core.flags import check_flags
    from polyfuse.generation.hooks import PhaseTimer  # the Stats block's phase times

    validate(args)
    inputs = read_inputs(args)
    device = pick_device(args.device)
    if args.flash_attention_fast_softmax is None:
        # optimum-habana's intent: fast softmax by default with Gaudi flash attention, an explicit value wins.
        args.flash_attention_fast_softmax = bool(args.use_flash_attention and device.type == "hpu")
    if args.bucket_size is None:
        args.bucket_size = default_bucket_size(device.type, args.max_new_tokens)
    prepare_output_dir(args)
    flags = {name: getattr(args, name) for name in FLAG_NAMES}
    flags, warnings = check_flags(device.type, flags)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    torch.manual_seed(args.seed)
    model, tokenizer = load(args, device, flags)
    texts, used = check_prompts(args, tokenizer, render_inputs(args, tokenizer, inputs))
    if args.print_backends:
        from polyfuse.quant.report import report as quantization_report  # --quant: formats and their kernels

        print("\n".join(filter(None, [model.kernels.report(), quantization_report(model)])))
    runtime = model.runtime
    gen = runtime.sampling_generator(args.seed)  # HPU: None, its default generator seeded (no host draws)

    def one_run(timer=None):
        from polyfuse.cli.generation_options import cli_generation_kwargs  # --num_beams, --stream, ... (args.py)

        t0 = time.perf_counter()
        prompts, ids, mask = encode(args, tokenizer, texts, device)
        out = model.generate(
            ids,
            mask,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=gen,
            ignore_eos=args.ignore_eos,
            bucket_size=args.bucket_size,
            use_cache=args.use_kv_cache,
            hooks=timer,
            **cli_generation_kwargs(args, tokenizer),
        )
        return prompts, ids, out, time.perf_counter() - t0

    t0 = time.perf_counter()
    for i in range(args.warmup):
        print(f"Warming up iteration {i + 1}/{args.warmup}", flush=True)
        one_run()
    runtime.synchronize()
    compile_s = time.perf_counter() - t0
    runtime.reset_peak_memory()

    firsts, rests, e2es, new_tokens = [], [], [], 0
    t0 = time.perf_counter()
    for i in range(args.n_iterations):
        timer = PhaseTimer(runtime)
        prompts, ids, out, e2e = one_run(timer)
        timings = timer.timings
        new_tokens += timings["new_tokens"] * out.shape[0]  # rows returned: batch x --num_return_sequences
        firsts.append(timings["first_token_s"])
        rests.append(timings["rest_s"] / max(timings["new_tokens"] - 1, 1))
        e2es.append(e2e)
        print(
            f"Iteration {i + 1}/{args.n_iterations}: first token {firsts[-1] * 1e3:.2f} ms, "
            f"rest {rests[-1] * 1e3:.2f} ms/token, end to end {e2e * 1e3:.2f} ms",
            flush=True,
        )
    duration = time.perf_counter() - t0
    outputs = tokenizer.batch_decode(
        out[:, ids.shape[1] :] if args.print_new_text_only else out, skip_special_tokens=True
    )
    mem = runtime.memory_stats()
    result = {
        "throughput": new_tokens / duration,
        "avg_first_token_latency": 1e3 * sum(firsts) / len(firsts),
        "avg_rest_token_latency": 1e3 * sum(rests) / len(rests),
        "avg_e2e_latency": 1e3 * sum(e2es) / len(e2es),
        "graph_compilation_duration": compile_s,
        "memory": mem,
        "input": [used[i % len(used)] for i in range(len(prompts))],  # as used: after truncation
        "output": outputs,
        "backends": model.kernels.as_dict(),
        "device": device.type,
        "args": run_arguments(args),
    }
    print_report(result, args)
    if args.output_dir:
        write_results(args.output_dir, result)
    return result


def print_report(r: dict, args) -> None:
    print("\nInput/outputs:")
    per_input = max(len(r["output"]) // max(len(r["input"]), 1), 1)  # --num_return_sequences: rows i * n + j
    for i, inp in enumerate(r["input"]):
        print(f"input {i + 1}: {(inp,)}")
        for j, out in enumerate(r["output"][i * per_input : (i + 1) * per_input]):
            print(f"output {i + 1}.{j + 1}: {(out,)}")
        print()
    lines = [
        "Input tokens",
        f"Throughput (including tokenization) = {r['throughput']} tokens/second",
        f"Average first token latency         = {r['avg_first_token_latency']} ms",
        f"Average rest token latency          = {r['avg_rest_token_latency']} ms",
        f"Average end to end latency          = {r['avg_e2e_latency']} ms",
    ]
    for k, v in r["memory"].items():
        if v is not None:
            lines.append("{:35} = {} GB".format(k[:-5].replace("_", " ").capitalize(), v))
    lines.append(f"Graph compilation duration          = {r['graph_compilation_duration']} seconds")
    sep = "-" * max(len(s) for s in lines)
    print("Stats:\n" + sep + "\n" + "\n".join(lines) + "\n" + sep)


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
    except (UsageError, CheckpointError, ValueError, FileNotFoundError) as e:
        print("error: " + one_line(e), file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError:
        print("error: out of GPU memory; lower --batch_size or --max_new_tokens", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
