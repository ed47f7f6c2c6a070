"""One rank of tests/test_hpu_multicard.py, started by examples/spawn.py: on the TEST DOUBLE of habana_frameworks
(lazy mode), what polyfuse's HPU runtime does in a multi-card run with HPU graphs. Writes its findings as JSON."""

import json
import os
import sys

import torch
import torch.distributed as dist


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    before = os.environ.get("PT_HPU_ENABLE_LAZY_COLLECTIVES")
    from polyfuse.core.runtime import get_runtime

    runtime = get_runtime("hpu")  # imports the bridge; sets the variable first where the run has several ranks
    dist.init_process_group("gloo")
    step = runtime.graph_module(torch.nn.Linear(4, 4).to("hpu"), "decode", {"use_hpu_graphs": True})
    x = torch.ones(2, 4, device="hpu")
    y = [step(x).cpu().tolist() for _ in range(2)]
    import habana_frameworks

    result = {
        "rank": rank,
        "world": dist.get_world_size(),
        "before": before,
        "lazy_collectives": os.environ.get("PT_HPU_ENABLE_LAZY_COLLECTIVES"),
        "layer_hook": runtime.layer_hook() is not None,
        "graphs": [n for n, _, _ in habana_frameworks.CALLS if n.startswith("hpu_graph")],
        "same": y[0] == y[1],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
