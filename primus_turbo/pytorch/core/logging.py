"""Library logger, level from ``PRIMUS_TURBO_LOG_LEVEL`` (default WARNING)."""

from __future__ import annotations

import logging

from .env import env_str

__all__ = ["get_logger", "warn_once"]

_LOGGER_NAME = "primus_turbo"
_warned: set[str] = set()


def get_logger() -> logging.Logger:
    logger = logging.getLogger(_LOGGER_NAME)
    if not getattr(logger, "_primus_turbo_configured", False):
        level = env_str("PRIMUS_TURBO_LOG_LEVEL").upper() or "WARNING"
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(
                f"PRIMUS_TURBO_LOG_LEVEL={level!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
            )
        logger.setLevel(level)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[primus_turbo %(levelname)s] %(message)s"))
            logger.addHandler(handler)
        logger._primus_turbo_configured = True  # type: ignore[attr-defined]
    return logger


def warn_once(key: str, message: str) -> None:
    """Log ``message`` at WARNING the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    get_logger().warning(message)
