"""Loggers: write spooled or tapped logs to a backend, on a background thread."""

from ._array import ArrayLogger as ArrayLogger, read_arrays as read_arrays
from ._base import AbstractLogger as AbstractLogger
from ._console import ConsoleLogger as ConsoleLogger
from ._host import records as records, safe_name as safe_name, unique_name as unique_name
from ._jsonl import JsonlLogger as JsonlLogger, read_jsonl as read_jsonl
from ._mlflow import MLflowLogger as MLflowLogger
from ._multi import MultiLogger as MultiLogger
from ._progress import ProgressLogger as ProgressLogger
from ._sink import NonfiniteWarning as NonfiniteWarning
from ._state import LoggerState as LoggerState
from ._tensorboard import TensorBoardLogger as TensorBoardLogger
from ._trackio import TrackioLogger as TrackioLogger
from ._wandb import WandbLogger as WandbLogger
from ._writer import (
    WriteReport as WriteReport,
    WriterError as WriterError,
    WriterWarning as WriterWarning,
)
