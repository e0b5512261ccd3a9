"""Ray-based P/D launcher (`vllm-patch launch`) and the demo (`vllm-patch demo`).

Ray places and supervises; each instance is a real vLLM OpenAI server
process started by a Ray actor on its node (vllm_patch.launch.supervisor),
the router (vllm_patch.launch.router) runs in the launching process. The
launcher logs its progress (loggers under `vllm_patch.launch`); the commands
show it with `show_progress()`."""

from __future__ import annotations

import logging
import sys
from typing import TextIO


class _ProgressFormatter(logging.Formatter):
    """The message alone; from WARNING up, prefixed with the level."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        return msg if record.levelno < logging.WARNING else f"{record.levelname}: {msg}"


def show_progress(stream: TextIO | None = None) -> None:
    """Print the launcher's log lines (INFO and up) on `stream` (stderr), as
    a command's progress output. Idempotent; the lines then stay out of any
    other handler of this process."""
    log = logging.getLogger(__name__)
    if any(isinstance(h.formatter, _ProgressFormatter) for h in log.handlers):
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_ProgressFormatter())
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
