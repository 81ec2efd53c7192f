import functools
import os
import re
import socket
import struct
import time
from typing import IO, Any

import equinox as eqx
import numpy as np

from ._base import AbstractLogger
from ._host import Record, finite, flat_items, is_scalar, not_complex, process_suffix, require
from ._run_config import flat_config


@functools.cache
def _tensorflow_bins() -> list[float]:
    """TensorFlow's default histogram bucket edges (as `SummaryWriter.add_histogram` uses):
    +-1e-12 growing by 10% up to 1e20, and 0."""
    edges = 1e-12 * 1.1 ** np.arange(int(np.ceil(np.log(1e32) / np.log(1.1))))
    return [*(-edges[::-1]).tolist(), 0.0, *edges.tolist()]


class _EventFile:
    """One TensorBoard event file, written synchronously: TFRecord framing of `Event` protos.

    tensorboardX's own `SummaryWriter` queues events for a thread of its own (its `flush` does
    not wait for it, and a failing write kills that thread and blocks the next `put`), and
    names its file by the second, so a second writer within the same second truncates the
    first's file. Here the logger's writer thread writes each record itself, into a file of
    its own (opened exclusively, named by `_file_name` to sort after every earlier one), and
    errors surface as the logger's `WriterError`."""

    def __init__(self, directory: str, fsync_every: float):
        tbx = require("tensorboardX", "tensorboard", "TensorBoardLogger")
        from tensorboardX.proto import event_pb2, summary_pb2
        from tensorboardX.record_writer import masked_crc32c

        self._event, self._summary, self._crc = event_pb2.Event, summary_pb2.Summary, masked_crc32c
        self._histogram, self._hparams = tbx.summary.histogram, tbx.summary.hparams
        os.makedirs(directory, exist_ok=True)
        for _ in range(100):
            try:
                self.file: IO[bytes] = open(os.path.join(directory, _file_name(directory)), "xb")
                break
            except FileExistsError:  # another logger took that name just now: the next one
                continue
        else:
            raise FileExistsError(f"{directory}: found no free name for a new event file.")
        self.fsync_every, self.synced = fsync_every, time.monotonic()
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        checks = [struct.pack("<I", self._crc(x)) for x in (header, data)]
        self.file.write(header + checks[0] + data + checks[1])  # TFRecord framing

    def scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)])
        self._write(self._event(wall_time=time.time(), step=step, summary=summary))

    def histogram(self, tag: str, values: np.ndarray, step: int) -> None:
        summary = self._histogram(tag, values, _tensorflow_bins())
        summary.value[0].tag = tag  # as the key is: tensorboardX would rewrite some characters
        self._write(self._event(wall_time=time.time(), step=step, summary=summary))

    def hparams(self, values: dict[str, str | bool | int | float]) -> None:
        """The HParams plugin's session start info: `values` as this run's hparams."""
        summary = self._hparams(values, {})[1]  # (experiment, session start, session end)
        self._write(self._event(wall_time=time.time(), summary=summary))

    def flush(self) -> None:
        self.file.flush()
        if time.monotonic() - self.synced >= self.fsync_every:
            os.fsync(self.file.fileno())
            self.synced = time.monotonic()

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


# What TensorBoard's writers name event files: `events.out.tfevents.<seconds>.<...>`; ours
# are `events.out.tfevents.<seconds>.<sequence, 6 digits>.<host>.<pid>`.
_EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d{10})(?:\.(\d{6})\.)?")


def _file_name(directory: str) -> str:
    """A name for a new event file in `directory` that sorts after every event file there.

    TensorBoard reads a run's event files in name order, so a run reopened (or a second
    logger on the same logdir) must sort after what was written before, or its events are
    shown first. The seconds alone tie within a second, and a host or pid after them sorts at
    random: the name is the current second and a sequence number one past the last file's of
    that second; after another writer's file of that second (`<seconds>.<host>`), the next
    second; after a file from a later second (a clock set back), that second."""
    stamp, sequence = int(time.time()), 0
    names = [match for f in os.listdir(directory) if (match := _EVENT_FILE.match(f))]
    if names:
        last = max(names, key=lambda match: match.string)
        stamp = max(stamp, int(last[1]))
        if int(last[1]) == stamp:
            if last[2] is not None and int(last[2]) < 999_999:
                sequence = int(last[2]) + 1
            else:
                stamp += 1
    return f"events.out.tfevents.{stamp:010d}.{sequence:06d}.{socket.gethostname()}.{os.getpid()}"


class TensorBoardLogger(AbstractLogger):
    """TensorBoard event files (`pip install '.[tensorboard]'` from the checkout, which brings
    tensorboardX for the protos), one run directory per run, `logdir/run_<run>`: scalars, and
    arrays as histograms of their finite entries. The count of non-finite entries of an array,
    where there are any, goes to the run `run_<run>/nonfinite` under the key's own tag, so it
    never meets a user's key. Tags are the keys exactly; pytree values are logged per leaf as
    `<key>/<path>`. The global step is the event's `step` if it was logged with one, else a
    per-key counter.

    Every write is flushed to the operating system (a crash of the process loses only events
    not yet written); the files are fsynced at most every `fsync_every` seconds and on close.
    Each opening of a run writes a new event file, so closing and reopening, or two loggers on
    one logdir, never overwrite one another; its name sorts after every event file already in
    the run's directory, so TensorBoard, which reads them in name order, shows a reopened run's
    events after the earlier ones. A failed write (a full disk) is raised as the logger's
    `WriterError`.

    **Arguments:**

    - `logdir`: the directory (`tensorboard --logdir` it).
    - `step`: the step name to use as the global step.
    - `fsync_every`: seconds between fsyncs (0: after every write).
    - `config`: the run's configuration (keyword-only; see
        [`eqx_logs.loggers.AbstractLogger`][]), written to each run as its hparams (the
        HParams dashboard's session start info), flattened with dotted keys (`train.lr`;
        lists as JSON text). TensorBoard infers the experiment from the runs' hparams.

    !!! example

        The training loop of [`eqx_logs.loggers.AbstractLogger`][]'s example (`train`) with
        this logger:

        ```python
        from eqx_logs.loggers import TensorBoardLogger

        with TensorBoardLogger("tb", config={"lr": 0.1}) as logger:
            model, opt_state = train(logger, model, opt_state)
        # tensorboard --logdir tb
        ```
    """

    logdir: str = eqx.field(converter=os.fspath)
    step: str = "step"
    fsync_every: float = 1.0

    def __check_init__(self):
        require("tensorboardX", "tensorboard", "TensorBoardLogger")

    def _unstorable(self, leaf: np.ndarray) -> str | None:
        return not_complex(leaf)

    def _open(self, run: int) -> tuple[_EventFile, dict[str, _EventFile], dict[str, int]]:
        rundir = os.path.join(self.logdir, f"run_{run}{process_suffix(self.every_process)}")
        events = _EventFile(rundir, self.fsync_every)
        if self.config is not None:
            events.hparams(flat_config(self.config))
            events.flush()
        return events, {}, {}

    def _write(self, handle, run: int, records: list[Record]) -> None:
        events, side, counters = handle
        for r in records:
            for tag, value in flat_items(r["key"], r["value"]):
                if self.step in r:
                    step = int(np.asarray(r[self.step]))
                else:
                    step = counters.get(tag, 0)
                counters[tag] = step + 1
                if is_scalar(value):
                    events.scalar(tag, float(value.reshape(())), step)
                    continue
                entries = finite(value)
                if entries.size:
                    events.histogram(tag, entries.astype(np.float64), step)
                if entries.size != value.size:
                    if not side:
                        rundir = os.path.join(self.logdir, f"run_{run}", "nonfinite")
                        side["nonfinite"] = _EventFile(rundir, self.fsync_every)
                    side["nonfinite"].scalar(tag, value.size - entries.size, step)
        for file in [events, *side.values()]:
            file.flush()

    def _close(self, handle) -> None:
        events, side, _ = handle
        for file in [events, *side.values()]:
            file.close()
