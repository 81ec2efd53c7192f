import json
import os
import time
import warnings
from collections.abc import Callable
from typing import IO, Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ._base import AbstractLogger
from ._host import Record, process_path, to_python


class JsonlLogger(AbstractLogger):
    """One JSON line per event: `{"run": 0, "key": ..., "value": ..., "step": ...}` (spooled
    stacked keys give a line per real event; other reductions one line per key and call).
    Appends to an existing file. Every batch of writes is flushed to the operating system
    (the writes the writer thread takes together, the steps of a `logger.jit` loop queued
    while it wrote the last batch; one write alone otherwise), so a crash of the process
    loses only events not yet written; the file is also fsynced at most every `fsync_every`
    seconds and on close, so a crash of the machine loses at most that long.
    NaN and infinities are written as the strings `"nan"`, `"inf"` and `"-inf"` (the file is
    strict JSON); read it back with [`eqx_logs.loggers.read_jsonl`][], which makes them floats.

    With `config=` (see [`eqx_logs.loggers.AbstractLogger`][]), the logger writes the line
    `{"config": {...}}` before its first record: the first line of a new file (a logger
    appending to a file writes its own, further down). `read_jsonl` skips these lines.

    **Arguments:**

    - `path`: the file; its directory is created.
    - `fsync_every`: seconds between fsyncs (0: after every batch of writes).

    !!! example

        The training loop of [`eqx_logs.loggers.AbstractLogger`][]'s example (`train`) with
        this logger, its losses read back:

        ```python
        from eqx_logs.loggers import JsonlLogger, read_jsonl

        with JsonlLogger("run.jsonl") as logger:
            model, opt_state = train(logger, model, opt_state)
        losses = [r for r in read_jsonl("run.jsonl") if r["key"] == "loss"]
        print([r["step"] for r in losses])  # [0, 10, 20]
        ```
    """

    path: str = eqx.field(converter=os.fspath)
    fsync_every: float = 1.0

    def _open(self, run: int) -> tuple[IO[str], list[float]]:
        path = process_path(self.path, self.every_process)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _drop_torn_line(path)
        file = open(path, "a")
        written = self._sink.memo.setdefault(_CONFIG_WRITTEN, set())
        if self.config is not None and path not in written:  # once: the runs share the file
            written.add(path)
            file.write(json.dumps({"config": self.config}) + "\n")
            file.flush()
        return file, [time.monotonic()]

    def _write(self, handle: tuple[IO[str], list[float]], run: int, records: list[Record]):
        file, synced = handle
        file.write(lines(run, records))
        file.flush()
        self._synced(file, synced)

    def _write_many(
        self, handle: tuple[IO[str], list[float]], run: int, writes: list[list[Record]]
    ) -> None:
        """`_write` of each of `writes` (the records of several writes of run `run`, in
        order): one write to the file, all or nothing. Where it fails part way (a full
        disk), the file is cut back to where it ended before, so that every write of the
        batch is lost whole (the writer counts them all) and none is in the file."""
        file, synced = handle
        file.flush()  # (nothing is left in its buffer: every write is flushed)
        data = "".join([lines(run, records) for records in writes])
        if os.linesep != "\n":  # (as the text file writes its lines)
            data = data.replace("\n", os.linesep)
        fd = file.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)  # (appending: every write goes to the end)
        view = memoryview(data.encode())
        try:
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            try:
                os.ftruncate(fd, start)
            except OSError:  # (a line cut short is removed when the file is opened next)
                pass
            raise
        self._synced(file, synced)

    def _synced(self, file: IO[str], synced: list[float]) -> None:
        """Fsync `file` if the last fsync was `fsync_every` seconds ago or more."""
        if time.monotonic() - synced[0] >= self.fsync_every:
            os.fsync(file.fileno())
            synced[0] = time.monotonic()

    def _close(self, handle: tuple[IO[str], list[float]]) -> None:
        file, _ = handle
        file.flush()
        os.fsync(file.fileno())
        file.close()


def lines(run: int, records: list[Record]) -> str:
    """The lines of `records` of run `run`: `json.dumps({"run": run, **to_python(r)}) + "\\n"`
    for each, joined. Numpy scalars and strings (the common fields: a key, a scalar value, its
    steps) are formatted here, as `json.dumps` of `to_python` of them would be (`float.__repr__`,
    `int.__repr__`, `true`/`false`, `"nan"`, `"inf"`, `"-inf"`), at a tenth of its cost; any
    other value by `json.dumps`, which writes a value inside an object as it writes it alone."""
    head = f'{{"run": {int.__repr__(run)}' if type(run) is int else None
    out = []
    for record in records:
        if head is None or "run" in record:  # (a field named "run" would replace the run's)
            out.append(json.dumps({"run": run, **to_python(record)}) + "\n")
            continue
        parts = [head]
        for name, value in record.items():
            parts.append(_NAMES.get(name) or _name(name))
            encode = _ENCODE.get(type(value))
            parts.append(json.dumps(to_python(value)) if encode is None else encode(value))
        parts.append("}\n")
        out.append("".join(parts))
    return "".join(out)


_NAMES: dict[str, str] = {}  # a field's name -> `, "name": `
_STRINGS: dict[str, str] = {}  # a string value (a key) -> as JSON
_CACHED = 4096  # names and strings kept at most (each cache starts anew when full)


def _name(name: str) -> str:
    if len(_NAMES) >= _CACHED:
        _NAMES.clear()
    text = _NAMES[name] = f", {json.dumps(name)}: "
    return text


def _string(value: str) -> str:
    text = _STRINGS.get(value)
    if text is None:
        if len(_STRINGS) >= _CACHED:
            _STRINGS.clear()
        text = _STRINGS[value] = json.dumps(value)
    return text


def _float(value: Any) -> str:
    x = float(value)  # (exact for every float type here, as `.item()` is)
    return float.__repr__(x) if x - x == 0 else f'"{float.__repr__(x)}"'  # nan, inf, -inf


def _int(value: Any) -> str:
    return int.__repr__(int(value))


def _bool(value: Any) -> str:
    return "true" if value else "false"


# a value's type -> its JSON (what `json.dumps(to_python(value))` writes); other types: that
_ENCODE: dict[type, Callable[[Any], str]] = {
    str: _string,
    np.bool_: _bool,
    **{t: _int for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16)},
    **{t: _int for t in (np.uint32, np.uint64)},
    **{t: _float for t in (np.float16, np.float32, np.float64, jnp.bfloat16)},
}


_CONFIG_WRITTEN = "jsonl-config-written"  # `Sink.memo`'s key: the files given the config
_CHUNK = 1 << 16  # read backwards from the end in pieces this big


def _drop_torn_line(path: str) -> None:
    """A record is written whole, newline last: a last line without one was cut short (a
    crash, a full disk) and never held a record. Remove it before appending, so that the next
    record starts a line of its own."""
    try:
        file = open(path, "rb+")
    except FileNotFoundError:
        return
    with file:
        end = start = file.seek(0, os.SEEK_END)
        if end == 0:
            return
        while start > 0:
            size = min(_CHUNK, start)
            file.seek(start - size)
            chunk = file.read(size)
            if start == end and chunk.endswith(b"\n"):
                return  # the last line is whole
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                start = start - size + cut + 1
                break
            start -= size
        file.truncate(start)
    warnings.warn(
        f"{path}: removed a last line cut short by an earlier crash or full disk "
        f"({end - start} bytes, no complete record) before appending.",
        stacklevel=2,
    )


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JsonlLogger file. Non-finite floats, which the file spells as the
    strings `"nan"`, `"inf"` and `"-inf"` (strict JSON has no NaN), come back as floats, in
    values and steps alike, so that `min` or `np.mean` of the values work. The lines that
    hold a logger's config (`{"config": {...}}`, the first line of a file written with
    `config=`) are not records, and are skipped. A last line cut short by a crash is
    skipped; any other line that is not a record, and any line that is not UTF-8 text (a
    binary file), raises `ValueError` naming the file and the line."""
    out = []
    # undecodable bytes become lone surrogates, found line by line (a strict decoder fails
    # on a chunk of the file, before the lines that precede the bad byte in it)
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for number, line in enumerate(f, 1):
            if not line.isascii():
                _check_text(path, number, line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):
                    continue  # cut short by a crash: the record was never written
                raise ValueError(f"{os.fspath(path)}, line {number}: not JSON ({e.msg}).") from None
            if isinstance(record, dict) and record.keys() == {"config"}:
                continue  # the logger's config, not an event
            if not isinstance(record, dict) or not {"run", "key", "value"} <= record.keys():
                raise ValueError(
                    f"{os.fspath(path)}, line {number}: not a JsonlLogger record (an object "
                    f"with 'run', 'key' and 'value', or a config line): {line.strip()[:80]!r}."
                )
            if '"nan"' in line or 'inf"' in line:  # (cheap to look for on every line)
                record = {k: v if k == "key" else _floats(v) for k, v in record.items()}
            out.append(record)
    return out


_SPELLINGS = frozenset({"nan", "inf", "-inf"})  # `to_python`'s non-finite floats


def _floats(x: Any) -> Any:
    """`x` (a record's field, as read) with the strings `to_python` writes for non-finite
    floats back as floats."""
    if isinstance(x, str):
        return float(x) if x in _SPELLINGS else x
    if isinstance(x, list):
        return [_floats(v) for v in x]
    if isinstance(x, dict):
        return {k: _floats(v) for k, v in x.items()}
    return x


def _check_text(path: str | os.PathLike, number: int, line: str) -> None:
    """Raise if `line` (read with `errors="surrogateescape"`) held bytes that are not UTF-8.
    A JsonlLogger writes ASCII only, so such a line was never written by one, even cut short."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(line[e.start]) - 0xDC00  # the escape of byte b is U+DC00 + b
        raise ValueError(
            f"{os.fspath(path)}, line {number}: not UTF-8 text (byte {byte:#04x} at column "
            f"{e.start + 1}); not a JSONL file written by eqx_logs (a JsonlLogger writes "
            "ASCII JSON, one record a line)."
        ) from None
