"""The package logger: ``from tensorrt_llm.logger import logger``.

Library code logs through this object, never ``print``. The level comes from ``TRTLLM_LOG_LEVEL``
(see :mod:`tensorrt_llm.envs`) and can be changed with :meth:`Logger.set_level`.
``info_once`` / ``warning_once`` emit a message once per key, which is how one-time startup facts
(for example the ``[unified-kv]`` lines) are reported.
"""

from __future__ import annotations

import logging
import re
import sys

from tensorrt_llm import envs

_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "verbose": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


_FORMAT = "[TRT-LLM]{rank} [%(levelname)s] %(message)s"


class Logger:
    """A thin wrapper over :mod:`logging` with TensorRT-LLM's level names and once-only helpers."""

    def __init__(self, name: str = "tensorrt_llm") -> None:
        self._logger = logging.getLogger(name)
        self._logger.propagate = True
        if not self._logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT.format(rank="")))
            self._logger.addHandler(handler)
        self._seen: set[str] = set()
        self.set_level(envs.TRTLLM_LOG_LEVEL.get())

    def set_rank(self, rank: int | None) -> None:
        """Name this process's rank in every line (a model of several ranks, one process each);
        None: no rank."""
        label = "" if rank is None else f" [RANK {rank}]"
        for handler in self._logger.handlers:
            handler.setFormatter(logging.Formatter(_FORMAT.format(rank=label)))

    def set_level(self, level: str) -> None:
        key = level.lower()
        if key not in _LEVELS:
            raise ValueError(f"unknown log level {level!r}; expected one of {sorted(_LEVELS)}")
        self._logger.setLevel(_LEVELS[key])

    @property
    def level(self) -> int:
        return self._logger.level

    def debug(self, msg: str, *args: object) -> None:
        self._logger.debug(msg, *args)

    def info(self, msg: str, *args: object) -> None:
        self._logger.info(msg, *args)

    def warning(self, msg: str, *args: object) -> None:
        self._logger.warning(msg, *args)

    def error(self, msg: str, *args: object) -> None:
        self._logger.error(msg, *args)

    def info_once(self, msg: str, *args: object, key: str | None = None) -> None:
        if self._first_time(key or msg):
            self._logger.info(msg, *args)

    def warning_once(self, msg: str, *args: object, key: str | None = None) -> None:
        if self._first_time(key or msg):
            self._logger.warning(msg, *args)

    def _first_time(self, key: str) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


logger = Logger()


# a native library's log prefix ("[05:28:29] /project/cpp/grammar_parser.cc:820: ") and any
# source file's path (":line" with it): where a library failed is nobody's business but the log's
_NATIVE_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")
_FAILED_CHECK = re.compile(r"^Check failed: \(.*\)(?: is false)?:?")  # (a native assertion's code)
_SOURCE_PATH = re.compile(r"(?:[\w.~-]*/)+[\w.-]+\.(?:cc|cpp|cxx|cu|cuh|h|hpp|c|py)(?::\d+)?")


def plain_message(exc: BaseException, what: str = "a library") -> str:
    """``exc``'s message as a client may read it: its first line without a native library's
    clock time, source files and lines (never empty: the type's name then). The whole text goes
    to the log (INFO), under ``what`` failed."""
    text = str(exc).strip()
    logger.info("%s failed: %s: %s", what, type(exc).__name__, text)
    line = _NATIVE_PREFIX.sub("", text.splitlines()[0] if text else "")
    if check := _FAILED_CHECK.match(line):
        line = ": ".join(filter(None, ["an internal check failed", line[check.end() :].strip()]))
    line = _SOURCE_PATH.sub("<source>", line).strip()
    return line[:300] or type(exc).__name__
