"""Techniques: the interface and registry in ``base``, one module per technique family."""

from bench.techniques.base import TECHNIQUES, NoOptions, RunContext, Technique, option, resolve

from bench.techniques import accumulation, checkpointing, precision  # noqa: E402,F401,I001  (register)

__all__ = ["TECHNIQUES", "NoOptions", "RunContext", "Technique", "option", "resolve"]
