"""The tuned tile tables as data (polyfuse/backends/triton/configs, read by tuned.py) give the kernels the tiles the
Python dicts they replaced gave, for every (GPU, shape): a digest of those dicts, taken before they moved, and a few
of their entries, against the tables loaded now; the fallbacks (a GPU nobody tuned) and the tile_configs override."""

import hashlib
import json

import pytest

from polyfuse.backends.triton import tuned
from polyfuse.backends.triton.gemv import table_for


pytest.importorskip("triton")

from polyfuse.backends.triton.quant import gemm_common, gemm_q, gemv_common, gemv_gguf_a8  # noqa: E402


# sha256 of json.dumps(<the dicts>, sort_keys=True), the dicts as they were in _qgemv.py (TILES, SHAPE_TILES,
# PROGRAMS_PER_SM, PREFETCH_REGS, ROWS_PER_LAUNCH, ROW_TILES), _qgemm.py (TILES, RESHAPE), quant_gemm.MAX_ROWS,
# gemv_gguf_a8.MAX_ROWS and cuda/gemv_table.py (H200) before they became data, tuple keys joined by "|".
FROZEN_DIGEST = "25325a0dc8d695ca39cbadac0d01d7a619540a8dc72bf9406d7d5ebe2d66988e"
COUNTS = {"qgemv.TILES": 18, "qgemv.SHAPE_TILES": 45, "qgemv.PROGRAMS_PER_SM": 25, "qgemv.ROW_TILES": 18,
          "qgemm.TILES": 9, "gemv.H200": 28}  # fmt: skip
# Machines the tables must give those tiles on: the CPU interpreter, the GPU they were swept on, one nobody tuned.
GPUS = ("", "NVIDIA H200", "NVIDIA H100 80GB HBM3")


def _layout(device_name: str) -> dict:
    """The loaded tables for a GPU, laid out as the frozen dicts were."""
    q = gemv_common._tiles(device_name, "")

    def joined(*parts):
        return "|".join(str(p) for p in parts)

    return {
        "qgemv.TILES": {f: list(t) for f, t in q.formats.items()},
        "qgemv.SHAPE_TILES": {joined(f, *nk): list(t) for f, s in q.shapes.items() for nk, t in s.items()},
        "qgemv.PROGRAMS_PER_SM": {joined(f, *nk): v for f, s in q.per_sm.items() for nk, v in s.items()},
        "qgemv.PREFETCH_REGS": {f: r for f, r in q.prefetch_regs.items() if r},
        "qgemv.ROWS_PER_LAUNCH": gemv_common.ROWS_PER_LAUNCH,
        "qgemv.ROW_TILES": {joined(f, m): list(t) for f, rows in q.rows.items() for m, t in rows.items()},
        "qgemm.TILES": {f: list(t) for f, t in gemm_common._tiles(device_name, "").items()},
        "qgemm.RESHAPE": False,
        "quant_gemm.MAX_ROWS": gemm_q.MAX_ROWS,
        "gguf_a8.MAX_ROWS": gemv_gguf_a8.MAX_ROWS,
        "gemv.H200": {joined(n, k, sw): list(t) for (n, k, sw), t in table_for("NVIDIA H200").items()},
    }


@pytest.mark.parametrize("device_name", GPUS)
def test_every_table_gives_the_frozen_tiles(device_name):
    today = _layout(device_name)
    assert {k: len(today[k]) for k in COUNTS} == COUNTS
    assert hashlib.sha256(json.dumps(today, sort_keys=True).encode()).hexdigest() == FROZEN_DIGEST


def test_representative_entries():
    q = gemv_common.gemv_tiles("cpu")
    assert q.tile("int4", 4096, 4096) == (128, 64, 1, 2) and q.tile("int4", 1000, 1000) == (512, 64, 4, 3)
    assert q.tile("fp8", 57344, 8192) == (16, 512, 4, 4) and q.tile("gguf_q6_k", 6144, 4096) == (1, 1024, 1, 3)
    assert q.programs_per_sm("int4", 128256, 4096) == 32 and q.programs_per_sm("int8", 4096, 4096) == 2
    assert q.row_tile("gguf_q4_k_a8", 4096, 4096, 3) == (8, 1024, 4, 3)  # 3 rows launch as 4
    assert q.row_tile("gguf_q4_k_a8", 4096, 4096, 1) == (1, 2048, 1, 3)
    assert q.prefetch("int4", 16.0) == 2 and q.prefetch("int8", 1.0) == 0
    assert gemm_common.tiles_for("int4", 16) == (16, 32, 128, 4, 4)
    assert gemm_common.tiles_for("gguf_q4_k", 64) == (64, 32, 128, 8, 3)  # 64 rows: at least 8 warps
    h200 = table_for("NVIDIA H200")
    assert h200[(4096, 14336, True)] == (8, 512, 8, 2) and h200[(128256, 4096, False)] == (8, 2048, 4, 2)


def test_a_gpu_nobody_tuned_gets_the_documented_defaults():
    """The quantized kernels' tables default to the H200's sweeps (configs/<kind>/default.json); the bf16 GEMV has
    no default, so such a GPU keeps cuBLAS for every projection."""
    assert tuned.table("qgemv", "Some GPU") == tuned.table("qgemv", "") == tuned.table("qgemv", "NVIDIA H200")
    assert tuned.table("qgemm", "Some GPU") == tuned.table("qgemm", "")
    assert tuned.table("gemv", "Some GPU") == {} and table_for("AMD Instinct MI300X") == {}
    assert tuned.file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    for kind in ("gemv", "qgemv", "qgemm"):  # every table says why in one entry, which the loader drops
        files = sorted((tuned.CONFIGS / kind).glob("*.json"))
        assert files and all("_why" in json.loads(f.read_text()) for f in files), kind
        assert all(not k.startswith("_") for k in tuned.table(kind, "NVIDIA H200"))


def test_a_tile_configs_folder_replaces_entries_by_name(tmp_path):
    (tmp_path / "qgemv").mkdir()
    (tmp_path / "qgemv" / "NVIDIA_H200.json").write_text(json.dumps({"int8": {"tile": [8, 128, 2, 2]}}))
    (tmp_path / "gemv").mkdir()
    (tmp_path / "gemv" / "default.json").write_text(json.dumps({"linear": {"64,64": [4, 64, 1, 1]}}))
    mine = gemv_common._tiles("NVIDIA H200", str(tmp_path))
    assert mine.tile("int8", 6144, 4096) == (8, 128, 2, 2)  # the format's shapes went with its entry
    assert mine.tile("int4", 4096, 4096) == (128, 64, 1, 2)  # the other formats kept theirs
    assert gemv_common._tiles("Other GPU", str(tmp_path)).tile("int8", 6144, 4096) == (16, 512, 4, 4)
    gemv = table_for("NVIDIA H200", str(tmp_path))
    assert gemv[(64, 64, False)] == (4, 64, 1, 1) and (4096, 4096, False) not in gemv  # "linear" replaced whole
    assert gemv[(4096, 14336, True)] == (8, 512, 8, 2)  # "swiglu_linear" kept
    (tmp_path / "qgemm").mkdir()
    (tmp_path / "qgemm" / "default.json").write_text("{not json")
    with pytest.raises(ValueError, match="tile table .*qgemm/default.json"):
        tuned.table("qgemm", "", str(tmp_path))
    with pytest.raises(ValueError, match="not a folder"):
        tuned.table("qgemv", "", str(tmp_path / "missing"))
