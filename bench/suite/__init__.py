"""Suites: TOML files → frozen dataclasses, every problem in a file reported at once.

What the rest of the harness reads (Suite, RunSpec, Shapes, Fidelity, TechniqueSpec) is bench.spec,
re-exported. ``load`` reads a file; ``techniques`` and ``fidelity`` check those parts of it,
``values`` single values."""

from bench.errors import SuiteError
from bench.spec import Fidelity, RunSpec, Shapes, Suite, TechniqueSpec
from bench.suite.load import (
    load,
    select,
    spanning,
    varlen_steps,
    with_timeout,
    without_fidelity,
    zero_stages,
)

__all__ = [
    "Fidelity",
    "RunSpec",
    "Shapes",
    "Suite",
    "SuiteError",
    "TechniqueSpec",
    "load",
    "select",
    "spanning",
    "with_timeout",
    "without_fidelity",
    "varlen_steps",
    "zero_stages",
]
