"""Benchmark harness for PyTorch memory-saving training techniques."""

import logging

__version__ = "0.1.0"


def _quiet_enum_registrations(record: logging.LogRecord) -> bool:
    """torchao registers its Enums with torch's pytree, which torch now deprecates, and logs a
    warning for each at every import (peft imports torchao too): lines in every run's log that no
    user can act on."""
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_quiet_enum_registrations)


# What an optional package said at import that it could not load, by package: kept out of the user's
# terminal (bitsandbytes warns on every import that its CPU 4-bit kernels need the `kernels`
# package, which newcomers read as an error) and said once in each run's record (``package_notes``).
# Errors still show.
IMPORT_NOTES: dict[str, str] = {}
QUIETED = ("bitsandbytes",)


class _KeptAside(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            for handler in logging.getLogger().handlers or [logging.lastResort]:
                if handler is not None and record.levelno >= handler.level:
                    handler.handle(record)
            return
        IMPORT_NOTES.setdefault(record.name.split(".")[0], record.getMessage())


for _name in QUIETED:
    logging.getLogger(_name).addHandler(_KeptAside())
    logging.getLogger(_name).propagate = False
