import json
import os
import re
import zipfile
from typing import Any

import equinox as eqx
import numpy as np

from ._base import AbstractLogger
from ._host import (
    Record,
    flat_items,
    host_array,
    process_path,
    process_suffix,
    steps_of,
    unique_name,
)

_FILE = re.compile(r"^(\d+)\.npz$")
_CONFIG_WRITTEN = "array-config-written"  # `Sink.memo`'s key


class ArrayLogger(AbstractLogger):
    """Saves every event as its own `.npz` file, for large arrays: the value (each leaf of a
    pytree value under its path), its step values, and the key, at
    `path/run_<run>/<key>/<index>.npz` (the key made safe by `unique_name`). Float types numpy
    lacks (bfloat16, ...) are saved as float32. Each file is written to a temporary name and then
    renamed, so a crash never leaves a half-written file. Appends to existing runs. A run's
    folder is created when the logger is first asked to write to it, even with no events (a
    spooled call that logged nothing), so such a run reads back as `{}`; a logger that is never
    called creates nothing. Read back with [`eqx_logs.loggers.read_arrays`][] (which never
    unpickles).

    With `config=` (see [`eqx_logs.loggers.AbstractLogger`][]), the config is written as JSON
    to `path/config.json`, beside the runs, when the logger opens its first run (replacing
    what an earlier logger wrote there).

    **Arguments:**

    - `path`: the directory.

    !!! example

        The training loop of [`eqx_logs.loggers.AbstractLogger`][]'s example (`train`) with
        this logger, read back as arrays:

        ```python
        from eqx_logs.loggers import ArrayLogger, read_arrays

        with ArrayLogger("arrays") as logger:
            model, opt_state = train(logger, model, opt_state)
        events = read_arrays("arrays")["loss"]  # a dict per event: value, step/step
        print([int(event["step/step"]) for event in events])  # [0, 10, 20]
        ```
    """

    path: str = eqx.field(converter=os.fspath)

    def _open(self, run: int) -> dict[str, int]:
        os.makedirs(self._run_dir(run), exist_ok=True)  # a run without events reads as {}
        memo = self._sink.memo
        if self.config is not None and not memo.get(_CONFIG_WRITTEN):
            name = process_path(os.path.join(self.path, "config.json"), self.every_process)
            with open(name + ".tmp", "w") as f:
                json.dump(self.config, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(name + ".tmp", name)
            memo[_CONFIG_WRITTEN] = True
        return {}  # key -> next file index

    def _run_dir(self, run: int) -> str:
        return os.path.join(self.path, f"run_{run}{process_suffix(self.every_process)}")

    def _write(self, handle: dict[str, int], run: int, records: list[Record]) -> None:
        for r in records:
            key = r["key"]
            folder = os.path.join(self._run_dir(run), unique_name(key))
            if key not in handle:
                os.makedirs(folder, exist_ok=True)
                existing = [int(m[1]) for f in os.listdir(folder) if (m := _FILE.match(f))]
                handle[key] = max(existing, default=-1) + 1
            arrays: dict[str, Any] = {"__key__": np.asarray(key)}
            for name, leaf in flat_items("value", r["value"]):
                arrays[name] = leaf
            for name, step in steps_of(r).items():
                arrays[f"step/{name}"] = host_array(step)
            final = os.path.join(folder, f"{handle[key]:06d}.npz")
            with open(final + ".tmp", "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(final + ".tmp", final)
            handle[key] += 1


def read_arrays(path: str | os.PathLike, run: int = 0) -> dict[str, list[dict[str, Any]]]:
    """What an `ArrayLogger` wrote to run `run`: for each key, its events in order, each a dict
    with `"value"` (or `"value/<path>"` per leaf of a pytree value) and `"step/<name>"` arrays.
    Files are loaded with `allow_pickle=False`. A symbolic link (which an `ArrayLogger` never
    writes, and which could point outside the directory) or a file that is not an event raises
    `ValueError` naming it.

    A run that wrote no events (its folder is empty, or absent from `path`) gives `{}`. A
    `path` that does not exist raises `FileNotFoundError` naming it: a mistyped path, or a
    logger that was never called (an `ArrayLogger` creates `path` with its first run)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        if os.path.exists(path):
            raise NotADirectoryError(
                f"{path}: not a directory (read_arrays reads the directory an ArrayLogger "
                "was given as `path`)."
            )
        raise FileNotFoundError(
            f"{path}: no such directory. An ArrayLogger creates its `path` (and "
            "`run_<run>` in it) when it is first asked to write, even logs without events; "
            "check the path, or whether the logger was ever called."
        )
    root = os.path.join(path, f"run_{run}")
    _refuse_link(root)
    if not os.path.exists(root):
        return {}  # no event of this run was ever written
    out: dict[str, list[dict[str, Any]]] = {}
    for folder in sorted(os.listdir(root)):
        _refuse_link(os.path.join(root, folder))
        files = sorted(
            (int(m[1]), f) for f in os.listdir(os.path.join(root, folder)) if (m := _FILE.match(f))
        )
        for _, name in files:
            file = os.path.join(root, folder, name)
            _refuse_link(file)
            try:
                with np.load(file, allow_pickle=False) as data:
                    event = {k: data[k] for k in data.files}
            except (OSError, ValueError, zipfile.BadZipFile) as e:
                raise ValueError(f"{file}: not an ArrayLogger event ({e}).") from None
            if "__key__" not in event:
                raise ValueError(f"{file}: not an ArrayLogger event (it names no key).")
            key = str(event.pop("__key__"))
            out.setdefault(key, []).append(event)
    return out


def _refuse_link(path: str) -> None:
    if os.path.islink(path):
        raise ValueError(
            f"{path} is a symbolic link, to {os.readlink(path)!r}: an ArrayLogger never writes "
            "one, so it is not read."
        )
