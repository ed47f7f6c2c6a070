"""The generation settings: one validated dataclass with transformers' names and meanings (``GenerationConfig``),
plus polyfuse's own (``ignore_eos``, ``stop_token_ids``, ``bucket_size``, ``speculative_method``,
``num_speculative_tokens``).

``GenerationOptions.from_kwargs(generation_config=None, model_config=None, **kwargs)`` builds it once per
``generate()`` call with transformers' precedence (hf_config.py): the keywords, over the passed config, over the
model's ``generation_config``, over transformers' defaults (``top_k=50``; unset, the length is 20 new tokens, capped
at the model's positions, as transformers' default ``max_length=20``). A keyword given as None clears its field
(``top_k=None``: no top-k). A setting polyfuse does not implement is refused (TypeError as a keyword, ValueError in a
config), never ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from polyfuse.generation.hf_config import resolve
from polyfuse.generation.sampling import validate_sampling
from polyfuse.generation.stopping import as_stop_strings


DEFAULT_NEW_TOKENS = 20
SPECULATIVE_METHODS = ("prompt_lookup", "draft", "eagle3")
MAX_SPECULATIVE_TOKENS = 32  # the widest verify step: k drafted tokens + 1 in one target forward


def _bad_words(value) -> Optional[tuple]:
    if value is None:
        return None
    if not value or any(not isinstance(w, (list, tuple)) or not w for w in value):
        raise ValueError(f"bad_words_ids must be a list of non-empty lists of token ids, got {value!r}")
    return tuple(tuple(int(t) for t in w) for w in value)


def _ids(value: Union[int, Sequence[int], None]) -> Optional[tuple]:
    if value is None:
        return None
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _is_count(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: Optional[int] = None  # None: max_length - prompt length when max_length is set, else 20
    max_length: Optional[int] = None  # prompt + new tokens (transformers' meaning); max_new_tokens wins
    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    repetition_penalty: float = 1.0
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    stop_strings: Union[str, Sequence[str], None] = ()  # kept as a tuple of strings
    eos_token_id: Union[int, Sequence[int], None] = None  # None: the model config's; kept as a tuple
    pad_token_id: Optional[int] = None  # None: the config's, else the first EOS id, else 0
    stop_token_ids: Union[int, Sequence[int], None] = ()  # extra ids that end a row like EOS (kept with ignore_eos)
    ignore_eos: bool = False
    bucket_size: int = -1  # KV cache and attended length in multiples of this (<= 0: one static length)
    use_cache: bool = True  # False: recompute the whole sequence every token
    # Speculative decoding (generation/speculative; the models are generate()'s assistant_model / speculative_model)
    prompt_lookup_num_tokens: Optional[int] = None  # transformers': k of prompt lookup (n-gram matching)
    max_matching_ngram_size: Optional[int] = None  # transformers': longest n-gram prompt lookup matches (default 2)
    num_assistant_tokens: Optional[int] = None  # transformers': k of assistant_model (a draft model)
    speculative_method: Optional[str] = None  # "prompt_lookup", "draft" or "eagle3" (default: from what is given)
    num_speculative_tokens: Optional[int] = None  # k of any method (default: the method's)
    min_length: int = 0  # EOS is masked until the row (prompt included) is this long
    min_new_tokens: Optional[int] = None  # EOS is masked for this many new tokens
    no_repeat_ngram_size: int = 0
    bad_words_ids: Optional[Sequence[Sequence[int]]] = None  # kept as a tuple of tuples
    return_dict_in_generate: bool = False  # a transformers GenerateDecoderOnlyOutput / GenerateBeamDecoderOnlyOutput
    output_scores: bool = False  # with return_dict_in_generate: each step's processed scores
    output_logits: bool = False  # with return_dict_in_generate: each step's raw logits

    def __post_init__(self):
        # Normalized once here, so every reader sees tuples (frozen: set through object.__setattr__).
        object.__setattr__(self, "stop_strings", as_stop_strings(self.stop_strings))
        object.__setattr__(self, "eos_token_id", _ids(self.eos_token_id))
        object.__setattr__(self, "stop_token_ids", _ids(self.stop_token_ids) or ())
        object.__setattr__(self, "bad_words_ids", _bad_words(self.bad_words_ids))
        self.validate()

    def validate(self) -> None:
        """One-line ValueErrors for settings that cannot run (the CLI prints them as ``error:`` lines)."""
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_length is not None and not _is_count(self.max_length, 1):
            raise ValueError(f"max_length must be an integer >= 1, got {self.max_length!r}")
        validate_sampling(self.temperature, self.top_k, self.top_p)
        if not _is_count(self.num_beams, 1):
            raise ValueError(f"num_beams must be an integer >= 1, got {self.num_beams!r}")
        if not _is_count(self.num_return_sequences, 1):
            raise ValueError(f"num_return_sequences must be an integer >= 1, got {self.num_return_sequences!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        n, beams = self.num_return_sequences, self.num_beams
        if beams > 1 and self.do_sample:
            raise ValueError(
                "beam sampling (do_sample with num_beams > 1) is not supported: use num_beams=1 to sample, or "
                "do_sample=False for beam search"
            )
        if beams > 1 and n > beams:
            raise ValueError(f"num_return_sequences ({n}) must be <= num_beams ({beams}) for beam search")
        if beams == 1 and n > 1 and not self.do_sample:
            raise ValueError(
                f"num_return_sequences={n} needs do_sample=True or num_beams >= num_return_sequences "
                "(greedy decoding returns one sequence per prompt)"
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        for name in ("min_length", "no_repeat_ngram_size"):
            if not _is_count(getattr(self, name), 0):
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.min_new_tokens is not None and not _is_count(self.min_new_tokens, 0):
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        self._validate_speculation()

    def _validate_speculation(self) -> None:
        for name in ("prompt_lookup_num_tokens", "num_assistant_tokens", "num_speculative_tokens"):
            value = getattr(self, name)
            if value is not None and not (_is_count(value, 1) and value <= MAX_SPECULATIVE_TOKENS):
                raise ValueError(f"{name} must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {value!r}")
        if self.max_matching_ngram_size is not None and not _is_count(self.max_matching_ngram_size, 1):
            raise ValueError(f"max_matching_ngram_size must be an integer >= 1, got {self.max_matching_ngram_size!r}")
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative_method!r}"
            )

    @classmethod
    def from_kwargs(cls, generation_config=None, model_config=None, **kwargs) -> "GenerationOptions":
        """From keyword arguments over a transformers ``GenerationConfig`` over the model's (hf_config.py)."""
        names = {f.name for f in dataclasses.fields(cls)}
        for name in kwargs:
            if name not in names:
                raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        return cls(**resolve(model_config, generation_config, kwargs, names))

    # -- what the engine reads ------------------------------------------------------------------------------------

    def new_tokens(self, prompt_len: int, max_positions: Optional[int] = None) -> int:
        """How many tokens to generate after a prompt of ``prompt_len``; the default (neither length set) stops at
        the model's ``max_positions``, as transformers' default does."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is None:
            room = DEFAULT_NEW_TOKENS if max_positions is None else max_positions - prompt_len
            return max(1, min(DEFAULT_NEW_TOKENS, room))
        if self.max_length <= prompt_len:
            raise ValueError(f"max_length ({self.max_length}) leaves no room after the prompt's {prompt_len} tokens")
        return self.max_length - prompt_len

    def eos_ids(self, config_eos) -> list:
        """The ids that end a row: the EOS ids (these options', else the config's; none with ignore_eos), then the
        stop token ids."""
        eos = [] if self.ignore_eos else list(self.eos_token_id or _ids(config_eos) or ())
        return eos + [t for t in self.stop_token_ids if t not in eos]

    @property
    def copies(self) -> int:
        """Rows per prompt: its beams, or its returned samples."""
        return self.num_beams if self.num_beams > 1 else self.num_return_sequences

    @property
    def penalty(self) -> Optional[float]:
        """The repetition penalty, None where it is off (1.0)."""
        return float(self.repetition_penalty) if self.repetition_penalty != 1.0 else None

    @property
    def greedy(self) -> bool:
        """Argmax tokens with no host-side check per token: what the in-place TokenStep can run."""
        return not self.do_sample and self.num_beams == 1 and not self.stop_strings

    @property
    def outputs(self) -> bool:
        """Per-step scores or logits are returned (``return_dict_in_generate`` with ``output_scores`` / _logits)."""
        return self.return_dict_in_generate and (self.output_scores or self.output_logits)

    def processors_needed(self, prompt_len: int) -> list:
        """The settings that need transformers' logits processors on each step's scores (hence the per-token loop:
        the in-place TokenStep runs argmax, the repetition penalty and EOS bookkeeping only)."""
        needs = [
            f"min_length={self.min_length}" if self.min_length > prompt_len else "",
            f"min_new_tokens={self.min_new_tokens}" if self.min_new_tokens else "",
            f"no_repeat_ngram_size={self.no_repeat_ngram_size}" if self.no_repeat_ngram_size else "",
            "bad_words_ids" if self.bad_words_ids else "",
        ]
        return [n for n in needs if n]


def check_runtime_objects(options: GenerationOptions, tokenizer=None, streamer=None) -> None:
    """One-line ValueErrors for the objects generate() takes besides the settings."""
    if options.stop_strings and tokenizer is None:
        raise ValueError(
            "stop_strings needs tokenizer= (a tokenizer, or a callable decoding a list of token ids to text)"
        )
    if streamer is None:
        return
    if options.num_beams > 1:
        raise ValueError("streaming is not supported with beam search (num_beams > 1), as in transformers")
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise ValueError(f"streamer must have put(token_ids) and end() methods, got {type(streamer).__name__}")


def check_generation_options(
    do_sample: bool = False,
    repetition_penalty: float = 1.0,
    num_beams: int = 1,
    num_return_sequences: int = 1,
    early_stopping: Union[bool, str] = False,
    stop_strings: Union[str, Sequence[str], None] = None,
    tokenizer=None,
    streamer=None,
) -> None:  # 8 parameters: the CLI's check of the flags it passes, by generate()'s names
    """The ValueError generate() would raise for these settings, without generating (polyfuse/cli)."""
    options = GenerationOptions(
        do_sample=do_sample, repetition_penalty=repetition_penalty, num_beams=num_beams,
        num_return_sequences=num_return_sequences, early_stopping=early_stopping, stop_strings=stop_strings,
    )  # fmt: skip
    check_runtime_objects(options, tokenizer, streamer)
