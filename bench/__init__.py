"""Benchmark harness for PyTorch memory-saving training techniques."""

import logging

__version__ = "0.1.0"


def _quiet_enum_registrations(record: logging.LogRecord) -> bool:
    """torchao registers its Enums with torch's pytree, which torch now deprecates, and logs a warning for
    each at every import (peft imports torchao too): lines in every run's log that no user can act on."""
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_quiet_enum_registrations)
