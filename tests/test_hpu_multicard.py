"""Multi-card Gaudi runs as optimum-habana's gaudi_spawn.py starts them, against the TEST DOUBLE of habana_frameworks
(tests/habana_double; two CPU processes on gloo, no HCCL): examples/spawn.py takes gaudi_spawn's arguments, and each
rank's HPU runtime sets PT_HPU_ENABLE_LAZY_COLLECTIVES and drops the per-layer mark_step. Nothing here has run on a
Gaudi."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from helpers import dist_env, free_port, run_session


ROOT = Path(__file__).parent.parent
DOUBLE = Path(__file__).parent / "habana_double"


def _spawn(tmp_path, *launcher, env_extra=None):
    env = dist_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(DOUBLE)]), PT_HPU_LAZY_MODE="1", **(env_extra or {}))
    env.pop("PT_HPU_ENABLE_LAZY_COLLECTIVES", None)
    cmd = [sys.executable, str(ROOT / "examples" / "spawn.py"), *launcher, "--master_port", str(free_port()),
           str(Path(__file__).parent / "hpu_tp_worker.py"), str(tmp_path)]  # fmt: skip
    return run_session(cmd, 240, env, ROOT)


@pytest.mark.slow
def test_tp2_under_the_spawner_with_hpu_graphs_sets_lazy_collectives(tmp_path):
    """``spawn.py --world_size 2 --use_deepspeed`` (gaudi_spawn's line; DeepSpeed absent here: torchrun, with one
    warning): on each rank the variable is set before the bridge starts, the HPU graph captures once and replays,
    and the per-layer mark_step is off (optimum-habana skips it when world size > 1)."""
    done = _spawn(tmp_path, "--world_size", "2", "--use_deepspeed")
    assert done.returncode == 0, done.stderr
    if importlib.util.find_spec("deepspeed") is None:
        assert done.stderr.count("warning: --use_deepspeed") == 1, done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["world"] == 2 and r["before"] is None and r["lazy_collectives"] == "true"
        assert r["layer_hook"] is False and r["same"]
        assert r["graphs"] == ["hpu_graph_capture", "hpu_graph_replay"]


def test_spawn_refuses_a_hostfile_in_one_line(tmp_path, capsys):
    from polyfuse.distributed.launch import spawn_main

    assert spawn_main(["--hostfile", "hosts", "--world_size", "2", "x.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --hostfile")


def test_spawn_parser_takes_gaudi_spawns_arguments():
    from polyfuse.distributed.launch import spawn_parser

    a = spawn_parser().parse_args(
        ["--world_size", "8", "--use_mpi", "--main_process_port", "29501", "run.py", "--bf16"]
    )
    assert (a.world_size, a.use_mpi, a.master_port, a.script, a.script_args) == (8, True, 29501, "run.py", ["--bf16"])


def test_graphs_under_tp_refused_when_lazy_collectives_are_off(monkeypatch):
    """PT_HPU_ENABLE_LAZY_COLLECTIVES=false with HPU graphs and several ranks: one line saying what to set."""
    from test_hpu_backend import _forget_habana, _import_double

    from polyfuse.backends.hpu import runtime as hpu_runtime

    _import_double(monkeypatch, True)
    monkeypatch.setenv("PT_HPU_ENABLE_LAZY_COLLECTIVES", "false")
    monkeypatch.setattr(hpu_runtime, "_distributed_world", lambda: 2)
    try:
        rt = hpu_runtime.HpuRuntime(hpu_runtime.torch.device("hpu"))
        assert rt.layer_hook() is None
        with pytest.raises(ValueError, match="PT_HPU_ENABLE_LAZY_COLLECTIVES=true"):
            rt.graph_module(hpu_runtime.torch.nn.Linear(2, 2), "decode", {"use_hpu_graphs": True})
    finally:
        _forget_habana()
