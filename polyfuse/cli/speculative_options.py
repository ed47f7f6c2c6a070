"""The speculative-decoding flags of ``polyfuse-generate`` (transformers' and optimum-habana's names where they
have one, vLLM's otherwise); polyfuse/cli/speculative_setup.py turns them into generate()'s arguments."""

import argparse


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (docs/speculative.md; needs --use_kv_cache)")
    g.add_argument(
        "--assistant_model",
        default=None,
        metavar="PATH",
        help="a draft model of the same tokenizer (folder, GGUF or Hub id), loaded like the model",
    )
    g.add_argument(
        "--prompt_lookup_num_tokens",
        type=int,
        default=None,
        metavar="K",
        help="prompt lookup: draft the K tokens that followed the last n-gram's earlier occurrence (transformers')",
    )
    g.add_argument(
        "--max_matching_ngram_size",
        type=int,
        default=None,
        metavar="N",
        help="prompt lookup: the longest n-gram matched (default: 2)",
    )
    g.add_argument(
        "--speculative_model",
        default=None,
        metavar="PATH",
        help="EAGLE-3 heads (config.json + model.safetensors), or a draft model with --speculative_method draft",
    )
    g.add_argument(
        "--speculative_method",
        default=None,
        choices=["eagle3", "draft", "prompt_lookup"],
        help="default: what the flags above give",
    )
    g.add_argument(
        "--num_speculative_tokens",
        type=int,
        default=None,
        metavar="K",
        help="tokens drafted per verify step, 1..32 (default: 10 for prompt lookup, 5 otherwise)",
    )
