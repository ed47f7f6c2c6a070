"""The speculative-decoding flags of ``polyfuse-generate`` (transformers' and optimum-habana's names where they
have one, vLLM's otherwise); polyfuse/cli/speculative_setup.py turns them into generate()'s arguments."""

import argparse


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (docs/speculative.md; needs --use_kv_cache)")
    g.add_argument(
        "--assistant_model",
        default=None,
        metavar="PATH",
        help="a draft model of the same tokenizer (folder, .gguf folder or Hub id) drafting k tokens a step for the "
        "model to verify in one forward; loaded like the model (--bf16, device, flags)",
    )
    g.add_argument(
        "--prompt_lookup_num_tokens",
        type=int,
        default=None,
        metavar="K",
        help="prompt lookup: draft the K tokens that followed the last n-gram's earlier occurrence in the prompt or "
        "output (transformers' n-gram matching; no second model: pays on text that repeats its input)",
    )
    g.add_argument(
        "--max_matching_ngram_size",
        type=int,
        default=None,
        help="prompt lookup: the longest n-gram matched (default 2)",
    )
    g.add_argument(
        "--speculative_model",
        default=None,
        metavar="PATH",
        help="EAGLE-3 heads in their published format (config.json + model.safetensors), or with "
        "--speculative_method draft a draft model",
    )
    g.add_argument(
        "--speculative_method",
        default=None,
        choices=["eagle3", "draft", "prompt_lookup"],
        help="default: eagle3 with --speculative_model, draft with --assistant_model, prompt_lookup with "
        "--prompt_lookup_num_tokens",
    )
    g.add_argument(
        "--num_speculative_tokens",
        type=int,
        default=None,
        metavar="K",
        help="tokens drafted per verify step, 1..32 (default: 10 for prompt lookup, 5 otherwise)",
    )
