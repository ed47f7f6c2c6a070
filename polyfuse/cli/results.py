"""--output_dir for polyfuse-generate: checked before the model loads, one results file per run (results.json, then
results-2.json, ... : a second run never replaces the first's), written whole or not at all, and a folder this run
created removed again when nothing was written into it (an error or Ctrl-C before the first result)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform

from polyfuse.cli.errors import UsageError


class OutputDirError(UsageError):
    """--output_dir cannot be used; the CLI prints it as one error line."""


def prepare_output_dir(path) -> bool:
    """Check ``path`` before the model loads, creating it if missing; True when this call created it."""
    if path is None:
        return False
    where = f"--output_dir {path}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputDirError(f"{where}: exists and is not a folder")
    created = not os.path.exists(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OutputDirError(f"{where}: cannot create it ({e.strerror or e})") from None
    probe = os.path.join(path, f".results.json.{os.getpid()}.probe")
    try:
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as e:
        remove_if_empty(path, created)
        raise OutputDirError(f"{where}: cannot write there ({e.strerror or e})") from None
    return created


def remove_if_empty(path, created: bool) -> None:
    """Remove ``path`` when this run created it and left nothing in it."""
    if path and created:
        with contextlib.suppress(OSError):
            os.rmdir(path)  # fails, as it should, when anything is inside


def results_name(index: int) -> str:
    return "results.json" if index == 1 else f"results-{index}.json"


def write_results(path: str, result: dict) -> str:
    """The run's results as the first free name of results.json, results-2.json, ...: written whole to a temporary
    file in the folder, then hard-linked to its name (which fails, rather than replacing, when another run took
    that name meanwhile) and the temporary removed. UTF-8, non-ASCII text as is. Returns the file's path."""
    tmp = os.path.join(path, f".results.json.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, ensure_ascii=False, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        for index in range(1, 10_000):
            target = os.path.join(path, results_name(index))
            if _claim(tmp, target):
                return target
        raise OutputDirError(f"--output_dir {path}: results.json ... results-9999.json are all taken")
    except OSError as e:
        raise OutputDirError(f"--output_dir {path}: writing results failed ({e.strerror or e})") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _claim(tmp: str, target: str) -> bool:
    """Give ``tmp``'s contents the name ``target`` unless it is taken (False). Where the file system has no hard
    links, the name is reserved by an exclusive create and the temporary renamed over the reservation."""
    try:
        os.link(tmp, target)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
    try:
        os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(target)  # the empty reservation: never left behind
        raise
    return True


def versions() -> dict:
    import torch
    import transformers

    import polyfuse

    return {
        "polyfuse": polyfuse.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def run_info(model, device, flags: dict, source: dict) -> dict:
    """What results.json says about the run besides its numbers: the model as loaded, the device, the run flags as
    they took effect, the op overrides and the versions."""
    ctx = model.kernels.context
    return {
        "model": dict(source, model_type=model.config.model_type, dtype=str(model.dtype).replace("torch.", "")),
        "device": device.type,
        "device_name": ctx.platform.device_name,
        "flags": dict(flags),
        "ops": ctx.overrides or "",
        "versions": versions(),
    }
