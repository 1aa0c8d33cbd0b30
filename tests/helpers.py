"""Specs for tests, and techniques that misbehave on purpose (named by import path, as users do)."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from bench import models
from bench.launch import Device
from bench.launch.local import run_isolated
from bench.models import ModelSpec
from bench.suite import RunSpec, Shapes, SuiteError, TechniqueSpec, load
from bench.techniques import RunContext, Step, Technique, offer, option


def spec(
    model: str = "vit-tiny",
    techniques: tuple[TechniqueSpec, ...] = (),
    batch_size: int = 8,
    image_size: int = 32,
    seq_len: int = 16,
    name: str = "run",
    warmup_steps: int = 1,
    measure_steps: int = 2,
    lengths: str | None = None,
    loader_workers: int = 0,
    **kw: Any,
) -> RunSpec:
    text = models.resolve(model).inputs == "tokens"
    shapes = Shapes(
        batch_size=batch_size,
        image_size=None if text else image_size,
        seq_len=seq_len if text else None,
        warmup_steps=warmup_steps,
        measure_steps=measure_steps,
        lengths=lengths,
        loader_workers=loader_workers,
    )
    common = {"seed": 0, "timeout_s": 120.0, "lr": 1e-3} | kw
    return RunSpec(
        suite="test",
        name=name,
        model=model,
        techniques=techniques,
        gpu=shapes,
        cpu=shapes,
        baseline="baseline",
        **common,
    )


def generation(
    techniques: tuple[TechniqueSpec, ...] = (),
    batch_size: int = 2,
    prompt_len: int = 32,
    new_tokens: int = 4,
    name: str = "run",
    **kw: Any,
) -> RunSpec:
    """A generation of llama-tiny (mode = "generate") at these shapes, on either device."""
    shapes = Shapes(
        batch_size=batch_size,
        seq_len=prompt_len + new_tokens,
        warmup_steps=1,
        measure_steps=2,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
    )
    common = {"seed": 0, "timeout_s": 120.0, "lr": 1e-3, "mode": "generate"} | kw
    return RunSpec(
        suite="test",
        name=name,
        model="llama-tiny",
        techniques=techniques,
        gpu=shapes,
        cpu=shapes,
        baseline="baseline",
        **common,
    )


def isolated(run: RunSpec, device: Device, **options: Any) -> dict[str, Any]:
    """The run in its own process (``run_isolated``), as its record stores it."""
    return run_isolated(run, device, **options).to_flat()


def tech(name: str, **options: Any) -> TechniqueSpec:
    return TechniqueSpec(name, tuple(sorted(options.items())))


MLP_PARAM_BYTES = (64 * 256 + 256 + 256 * 10 + 10) * 4


def mlp_step(optimizer: type[torch.optim.Optimizer], **options: Any):
    """Linear(64→256)→ReLU→Linear(256→10) on a batch of 32 (seed 0), with ``optimizer``: the model,
    the optimizer and its training step (cross entropy, gradients set to None after the update), one
    step taken already."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = optimizer(model.parameters(), **options)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return model, opt, step


def write_suite(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(text)
    return path


def suite_problems(tmp_path: Path, text: str) -> list[str]:
    """Every problem the loader reports for this suite text (it must refuse it)."""
    with pytest.raises(SuiteError) as info:
        load(write_suite(tmp_path, text))
    return info.value.problems


class SGD(Technique):
    """Plain SGD, so one step's update is exactly -lr × gradient."""

    @dataclass(frozen=True)
    class Config:
        lr: float = option(1.0, "learning rate")

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.config.lr)


class HalfMomentumSGD(Technique):
    """A user's optimizer that declares its axis: advice tries it beside the built-in optimizers."""

    axis = "optimizer"
    offers = (offer("half-momentum-sgd", lr=0.01),)

    @dataclass(frozen=True)
    class Config:
        lr: float = option(0.01, "learning rate")

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.config.lr, momentum=0.5)


class AllocateTooMuch(Technique):
    """Asks the allocator for an exabyte: an out-of-memory failure on any device."""

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        torch.empty(2**60, dtype=torch.uint8, device=ctx.device)
        return model


class Segfault(Technique):
    """Dies the way a broken kernel does: by a signal, with no Python exception."""

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        print("about to crash", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
        return model


class Sleep(Technique):
    """Sleeps BENCH_TEST_SLEEP seconds (read at run time, so the spec and its key stay the same)."""

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        if pid_file := os.environ.get("BENCH_TEST_PID_FILE"):
            # lets a test check the process is gone
            Path(pid_file).write_text(str(os.getpid()))
        time.sleep(float(os.environ.get("BENCH_TEST_SLEEP", "0")))
        return model


class KilledByTheHost(Technique):
    """Ends the way the kernel's OOM killer ends a process: SIGKILL, with no word of its own."""

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        # the run, not its prediction
        if not isinstance(next(model.parameters()), torch._subclasses.FakeTensor):
            time.sleep(3)  # long enough to be looked at
            os.kill(os.getpid(), signal.SIGKILL)
        return model


class DiesInFidelity(Technique):
    """Applies at once for the prediction and the measured steps, then is killed in the fidelity
    phase (the only one at the fidelity batch of 8, where the run's is 2), as a timeout or the host
    would kill it."""

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        if ctx.shapes.batch_size == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        return model


class SleepsInFidelity(Technique):
    """Applies at once for the prediction and the measured steps, then, in the fidelity phase (batch
    8, where the run's is 2), writes its process id to BENCH_TEST_PID_FILE and sleeps
    BENCH_TEST_SLEEP seconds."""

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        if ctx.shapes.batch_size == 8:
            Path(os.environ["BENCH_TEST_PID_FILE"]).write_text(str(os.getpid()))
            time.sleep(float(os.environ.get("BENCH_TEST_SLEEP", "0")))
        return model


class Unavailable(Technique):
    def unsupported(self, ctx: RunContext) -> str | None:
        return "needs a package this machine does not have (pip install nothing-real)"


class EnvProbe(Technique):
    """Asks the runner for an environment variable and reports what the run's process saw."""

    def env(self) -> dict[str, str]:
        return {"BENCH_PROBE": "set-by-technique"}

    def proof(self, steps: int) -> dict[str, Any]:
        return {"seen": os.environ.get("BENCH_PROBE")}


class TinyLoss(Technique):
    """A loss 1e-5 of the usual size, as a mean-reduced loss near convergence can be: its float16
    gradients fall below float16's smallest subnormal (6e-8) unless they are scaled."""

    def step(self) -> Step:
        return Step(scale_loss=lambda loss: loss * 1e-5)


class KeepsEveryLoss(Technique):
    """Keeps a copy of each micro-batch's loss for the whole run, as a loop that logs its losses
    as tensors does: the step's memory grows with its micro-batches, so no two of them stand for
    the rest."""

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.kept: list[torch.Tensor] = []

    def step(self) -> Step:
        return Step(scale_loss=self._kept)

    def _kept(self, loss: torch.Tensor) -> torch.Tensor:
        self.kept.append(loss.detach().clone())
        return loss


class ZeroLearningRate(Technique):
    """Harmful on purpose: an optimizer that never moves the weights, so the model learns
    nothing."""

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.0)


class FailOnRank1(Technique):
    """Breaks on one rank of a multi-process run only, as a rank with a bad GPU would."""

    distributed = True

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        if ctx.rank == 1:
            raise RuntimeError("rank 1 gave up")
        return model


class AbortOnRank1(Technique):
    """Kills rank 1 from inside, as a C++ abort in a collective would: no Python record is
    written."""

    distributed = True

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        if ctx.rank == 1:
            print("rank 1: about to abort", file=sys.stderr, flush=True)
            os.abort()
        return model


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _image_mlp(shapes: Shapes) -> nn.Module:
    """An image MLP: flatten, project, three residual blocks, head. A structure no built-in model
    has."""
    width = 32
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * shapes.image_size**2, width),
        nn.Sequential(*(_Residual(width) for _ in range(3))),
        nn.Linear(width, 10),
    )


# A user's own model as a suite names it ("tests.helpers:IMAGE_MLP"): no blocks given, so they are
# found.
IMAGE_MLP = ModelSpec(name="image-mlp", build=_image_mlp, inputs="image", num_classes=10)


def _densenet(shapes: Shapes) -> nn.Module:
    from torchvision.models import DenseNet

    return DenseNet(growth_rate=8, block_config=(3, 2), num_init_features=16, num_classes=10)


# Dense layers in a ModuleDict (torchvision's _DenseBlock), as DenseNet-121's 58 are.
DENSENET = ModelSpec(name="densenet-small", build=_densenet, inputs="image", num_classes=10)
# One linear layer: nothing repeats, so checkpointing has no block to wrap.
LINEAR = ModelSpec(
    name="linear",
    build=lambda shapes: nn.Sequential(nn.Flatten(), nn.Linear(3 * shapes.image_size**2, 10)),
    inputs="image",
    num_classes=10,
)


def _regnet(shapes: Shapes) -> nn.Module:
    from torchvision.models import regnet_y_400mf

    return regnet_y_400mf(num_classes=10)


REGNET = ModelSpec(name="regnet-y-400mf", build=_regnet, inputs="image", num_classes=10)


def _convnext_tiny(shapes: Shapes) -> nn.Module:
    from torchvision.models import convnext_tiny

    return convnext_tiny(num_classes=10)


# Layer norms on convolutions' outputs: 16-bit inputs under autocast, which CUDA runs in float32.
CONVNEXT = ModelSpec(name="convnext-tiny", build=_convnext_tiny, inputs="image", num_classes=10)


LM_VOCAB = 48  # the digits' tokens and their ten class tokens, for the fidelity phase


def _tiny_llama(shapes: Shapes) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=LM_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_cache=False,
        max_position_embeddings=max(128, shapes.seq_len),
    )
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


# A causal language model, trained on every position's next token.
TINY_LM = ModelSpec(
    name="tiny-llama",
    build=_tiny_llama,
    inputs="tokens",
    num_classes=LM_VOCAB,
    vocab_size=LM_VOCAB,
    objective="next-token",
    attention=True,
)
# Too few tokens for the digits' class tokens: the fidelity phase refuses it before building it.
SMALL_VOCAB_LM = ModelSpec(
    name="small-vocab",
    build=_tiny_llama,
    inputs="tokens",
    num_classes=24,
    vocab_size=24,
    objective="next-token",
)


class _ClassTokenOracle(nn.Module):
    """Reads the class token, each sequence's last before its padding, and predicts it at the
    position before: a language model that is always right, if it is scored where the class token is
    predicted."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))  # something for the optimizer to hold

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        logits = torch.zeros(*input_ids.shape, LM_VOCAB) + self.weight
        rows, last = torch.arange(len(input_ids)), attention_mask.sum(dim=1) - 1
        logits[rows, last - 1] += nn.functional.one_hot(input_ids[rows, last], LM_VOCAB)
        return {"logits": logits}


ORACLE_LM = ModelSpec(
    name="oracle",
    build=lambda shapes: _ClassTokenOracle(),
    inputs="tokens",
    num_classes=LM_VOCAB,
    vocab_size=LM_VOCAB,
    objective="next-token",
)


def _bert_base_layers(layers: int) -> ModelSpec:
    """BERT-base with another number of layers: their difference is one layer's figures."""

    def build(shapes: Shapes) -> nn.Module:
        from transformers import BertConfig

        from bench.models.text import _bert

        return _bert(BertConfig(num_hidden_layers=layers), shapes)

    return ModelSpec(
        name=f"bert-base-{layers}",
        build=build,
        inputs="tokens",
        num_classes=10,
        vocab_size=30522,
        attention=True,
    )


BERT_BASE_2, BERT_BASE_3 = _bert_base_layers(2), _bert_base_layers(3)


def _vit_l16(shapes: Shapes) -> nn.Module:
    from torchvision.models import vit_l_16

    return vit_l_16(weights=None, image_size=shapes.image_size)


VIT_L16 = ModelSpec(
    name="vit-l16", build=_vit_l16, inputs="image", num_classes=1000, attention=True
)


class HoldHalfAGibibyte(Technique):
    """Fills half a GiB of host memory once, then frees it: the process's RSS peak carries it
    afterwards."""

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        torch.ones(2**29, dtype=torch.uint8)
        return model


class ReportEnv(Technique):
    """Reports BENCH_PROBE as the run's process sees it, asking the runner for nothing."""

    def proof(self, steps: int) -> dict[str, Any]:
        return {"seen": os.environ.get("BENCH_PROBE")}


class RaisingChecks(Technique):
    """A user's technique whose own validation has a bug."""

    def problems(self, batch_size: int) -> list[str]:
        raise ZeroDivisionError("division by zero")


def scaled_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """A library's optimizer that reads the weights' values when it is made, which fake tensors have
    not."""
    params = list(params)
    largest = max(float(np.abs(p.detach().numpy()).max()) for p in params)
    return torch.optim.SGD(params, lr=0.01 / max(largest, 1e-6), momentum=0.9)


def scaled_sgd_without_values(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``scaled_sgd`` for fake tensors: the same optimizer, so the same state, whatever the weights
    hold."""
    return torch.optim.SGD(list(params), lr=0.01, momentum=0.9)


class ScaledSGD(Technique):
    """A user's technique whose library call needs values: it declares a stand-in for
    predictions."""

    stand_ins = {"tests.helpers:scaled_sgd": "tests.helpers:scaled_sgd_without_values"}

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return scaled_sgd(model.parameters())


class ScaledSGDUndeclared(ScaledSGD):
    stand_ins = {}
