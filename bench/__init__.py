"""Benchmark harness for PyTorch memory-saving training techniques.

A run's way from a suite file to a report, by the types it takes (every dotted name is importable
under bench; tests/test_house.py checks that each still is):

    suites/NAME.toml
      │  suite.load: every problem in the file at once, or a Suite
      ▼
    spec.Suite: its runs, each a spec.RunSpec (model, spec.TechniqueSpec, spec.Shapes)
      │  sweep.sweep through a launcher (launch.local.Local): a process per run, given a spec.Job
      ▼
    worker.measure, in that process (or in each of its ranks)
      │  recipe.Recipe: the model, its techniques, a Trainer, Inferencer or Generator
      │  predict.predict_run           → record.Prediction      the step on fake tensors, first
      │                                  (made ahead on spare cores, spec.Job carries it)
      │  measure.memory.tracked_step   → record.Memory          live bytes, what the peak held
      │  measure.timing.summarize      → record.Timing          the timed steps
      │  fidelity.run_fidelity         → record.FidelityResult  accuracy on real data
      ▼
    record.Record: those groups with record.Identity, record.Outcome, record.Data,
      │  record.Distributed and record.Provenance (a run over ranks: record.Record.merged)
      │  record.Record.to_flat: one flat JSON object, stored by results.store
      ▼
    results/SUITE/DEVICE/RUN.json
      │  results.load_records, results.to_frame: a pandas DataFrame, a row per run
      ▼
    report.build_report: the suite's page, Markdown and HTML, with plots; report.overview: all

bench predict takes the way as far as record.Prediction, a predict.table.Row per run with what a
budget or card asked of it, and prints them; bench fit stores a fit.Fit per run, its largest batch
probed (fit.Probe) beside the predicted one; bench advise ranks plans of techniques by their
predictions (advise.advise) and the records' figures (record.Accuracy and the throughputs).
"""

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
