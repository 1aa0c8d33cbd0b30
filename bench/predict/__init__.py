"""Predict a run's peak memory without a GPU: the run's step on fake tensors, counted by the
tracker.

Under ``FakeTensorMode`` every operator computes shapes and dtypes but allocates nothing, so a full
ResNet-50 step at batch 256 takes about a second on a laptop. The live-bytes tracker counts the fake
storages exactly as it counts real ones, in CUDA's 512-byte allocation granularity, and
a counter beside it counts the FLOPs of the step it measures, by torch's formulas.

Fake CUDA tensors cannot run backward without a CUDA context, so the fake tensors sit on the CPU and
stand for CUDA ones; where the two differ the prediction assumes (see ``ASSUMPTIONS``). What it
counts is tensor bytes: the CUDA allocator's peak adds workspaces (cuBLAS, cuDNN) and fragmentation
on top.

``fake`` runs and counts the step; ``cuda`` makes it CUDA's (its kernels, and what it keeps on the
host), ``autocast`` casts by CUDA's autocast lists; ``depth`` folds a deep model's step from its
steps at a few layers; ``budget`` finds the largest batch under a budget or on a card, and a
generation's longest context, ``lines`` reading the sizes a search tries off the curve through a few
traced ones; ``table`` predicts a suite, in processes, as a table; ``ahead`` makes a sweep's
predictions beside its runs.
"""

from bench.predict.ahead import Ahead, predict_run
from bench.predict.budget import RESERVE, Budget, largest_batch, parse_size, tensor_budget
from bench.predict.cuda import ASSUMPTIONS
from bench.predict.fake import predict
from bench.predict.table import markdown, suite_table

__all__ = [
    "ASSUMPTIONS",
    "Ahead",
    "RESERVE",
    "Budget",
    "largest_batch",
    "markdown",
    "parse_size",
    "predict",
    "predict_run",
    "suite_table",
    "tensor_budget",
]
