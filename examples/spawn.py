#!/usr/bin/env python
"""Run a script on N local devices, optimum-habana's launcher form, with torchrun's own machinery underneath:

    python examples/spawn.py --world_size 2 examples/run_generation.py --bf16 --use_kv_cache ...

is ``torchrun --standalone --nproc-per-node 2 examples/run_generation.py ...`` (docs/distributed.md).
"""

import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from polyfuse.distributed.launch import spawn_main  # noqa: E402


if __name__ == "__main__":
    sys.exit(spawn_main())
