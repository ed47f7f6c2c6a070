#!/usr/bin/env python
"""Text generation with polyfuse, driven like optimum-habana's examples/text-generation/run_generation.py.

    python examples/run_generation.py --prompt "What is the capital of France?" --use_chat_template --max_new_tokens 20
    python examples/run_generation.py --model_name_or_path /path/llama --bf16 --use_kv_cache --use_flash_attention \
        --use_cuda_graphs --max_new_tokens 256
"""

import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from polyfuse.cli.generate import main  # noqa: E402


if __name__ == "__main__":
    sys.exit(main())
