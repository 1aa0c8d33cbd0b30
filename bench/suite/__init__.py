"""Suites: TOML files → frozen dataclasses, every problem in a file reported at once.

``spec`` holds what the rest of the harness reads (Suite, RunSpec, Shapes, Fidelity, TechniqueSpec).
``load`` reads a file; ``techniques`` and ``fidelity`` check those parts of it, ``values`` single values.
"""

from bench.errors import SuiteError
from bench.suite.load import load, select, without_fidelity
from bench.suite.spec import Fidelity, RunSpec, Shapes, Suite, TechniqueSpec

__all__ = ["Fidelity", "RunSpec", "Shapes", "Suite", "SuiteError", "TechniqueSpec", "load", "select",
           "without_fidelity"]
