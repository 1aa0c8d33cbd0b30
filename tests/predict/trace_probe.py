"""Run by test_fake.py in fresh processes: ``python -m tests.predict.trace_probe [predict-first]``.

Every technique combination of the shipped suites, on the tiny model of its family: with
``predict-first``, all are predicted (as CUDA, as workers do on a GPU host; a CPU prediction runs
the same techniques' code on the same fake tensors) before any runs for real. Then each takes four
real steps from its seed: a state written by one update is read back by the next, and a head that
starts at zero (ViT's) sends the body no gradient in the first, so a bad state can first show in the
fourth loss. The losses (inference: the outputs' sums) are printed as JSON. A prediction that left
anything behind in the process (a cache filled from fake values, which read as 1) shows as a loss
that differs from the same run's in a process that predicted nothing.
"""

from __future__ import annotations

import json
import sys

import torch

from bench import models
from bench.predict import predict
from bench.suite import RunSpec, load
from bench.techniques import RunContext, Unsupported, build
from tests.conftest import CPU, build_trainer
from tests.helpers import spec

# ViT first: a combination the suites share runs on vit-tiny, whose few parameter shapes keep
# torchao's per-shape compilation short (ResNet's dozens of kernel shapes took 90 s of it, cold).
SUITES = ("vit", "bert", "resnet", "smoke", "vit-infer", "bert-infer", "resnet-infer")
TINY = {"resnet": "resnet-tiny", "bert": "bert-tiny", "vit": "vit-tiny"}


def runs() -> dict[str, RunSpec]:
    """One spec per combination of techniques in the shipped suites (and mode), on the tiny model of
    the family it first appears with; and each family's plain model."""
    out = {}
    for name in SUITES:
        for run in load(f"suites/{name}.toml").runs:
            model = next(tiny for family, tiny in TINY.items() if family in run.model)
            key = f"{run.mode}:{'+'.join(t.label for t in run.techniques) or model}"
            out.setdefault(
                key, spec(model, run.techniques, batch_size=8, mode=run.mode, name=run.name)
            )
    return out


def runnable(run: RunSpec) -> bool:
    """What runs here for real: one process (no sharding), supported on a CPU, and predicted at all
    (compile and jit-trace are not, so they can leave nothing behind; compiling would take
    minutes)."""
    built = [build(t) for t in run.techniques]
    if any(t.distributed or t.unpredictable for t in built):
        return False
    ctx = RunContext(device=CPU, model_spec=models.resolve(run.model), shapes=run.cpu, lr=run.lr)
    return not any(t.unsupported(ctx) for t in built)


def main(predict_first: bool) -> None:
    specs = runs()
    if predict_first:
        for run in specs.values():
            predict(run, cuda=True)
    out = {}
    for key, run in specs.items():
        if runnable(run):
            trainer, batch = build_trainer(run)
            try:
                out[key] = [_value(trainer.step(batch)) for _ in range(4)]
            except Unsupported:  # found out only when it runs (a kernel that refuses the call)
                continue
    print(json.dumps(out))


def _value(result: object) -> float:
    return float(result.float().sum()) if isinstance(result, torch.Tensor) else float(result)


if __name__ == "__main__":
    main("predict-first" in sys.argv[1:])
