"""Loggers: where spooled logs go on the host."""

from ._base import AbstractLogger as AbstractLogger, records as records
from ._console import ConsoleLogger as ConsoleLogger
from ._jsonl import JsonlLogger as JsonlLogger, read_jsonl as read_jsonl
