"""The harness's training step holds exactly what a hand-written loop doing the same thing holds: its tracked peak
equals the hand loop's to the byte, technique by technique (anything the harness added would be reported as the
technique's own)."""

from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.hooks import RemovableHandle

from bench.data.synthetic import clone_batch
from bench.measure.memory import tracked_step
from bench.suite import TechniqueSpec
from tests.conftest import CPU, build_trainer
from tests.helpers import spec


class Hand:
    """A hand-written loop: ``model`` with an ``optimizer``, the batch cast to ``dtype``, split in ``micro``
    micro-batches, under bf16 autocast where asked."""

    def __init__(self, model: nn.Module, optimizer: type | None = torch.optim.AdamW, dtype: torch.dtype | None = None,
                 micro: int = 1, autocast: bool = False, keep_grads: bool = False,
                 layout: torch.memory_format = torch.contiguous_format, **options: float) -> None:
        self.model = (model.to(dtype) if dtype else model).to(memory_format=layout)
        self.optimizer = optimizer(self.model.parameters(), **({"lr": 1e-3} | options)) if optimizer else None
        self.dtype, self.micro, self.autocast, self.keep_grads = dtype, micro, autocast, keep_grads
        self.layout = layout
        self.counted: object = self.optimizer  # what the tracker counts as optimizer state

    def step(self, batch: list) -> torch.Tensor:
        """One step; the mean loss, summed over the micro-batches as a loop that logs it does."""
        inputs, labels = batch.pop()  # the caller keeps no reference: a cast frees the batch as it came
        if self.dtype:
            inputs = inputs.to(self.dtype)
        inputs = inputs.contiguous(memory_format=self.layout)
        total = None
        for x, y in zip(inputs.tensor_split(self.micro), labels.tensor_split(self.micro)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss = nn.functional.cross_entropy(self.model(x), y) / self.micro
            total = loss.detach() if total is None else total + loss.detach()
            loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        return total


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module, selective: bool = False) -> None:
        super().__init__()
        self.block, self.selective = block, selective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.selective:  # PyTorch's documented recipe: keep the matmuls' outputs, recompute the rest
            return checkpoint(self.block, x, use_reentrant=False,
                              context_fn=lambda: create_selective_checkpoint_contexts(keep_matmuls))
        return checkpoint(self.block, x, use_reentrant=False)


def keep_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    aten = torch.ops.aten
    matmuls = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default)
    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(model: nn.Module, every: int = 1, selective: bool = False) -> Hand:
    layers = model.encoder.layers  # torchvision's ViT blocks
    for name, block in list(layers.named_children())[::every]:
        setattr(layers, name, Checkpointed(block, selective))
    return Hand(model)


def in_backward(model: nn.Module) -> Hand:
    """PyTorch's optimizer_step_in_backward tutorial: an AdamW per parameter, stepped from its gradient's hook."""
    steps = {p: torch.optim.AdamW([p], lr=1e-3, foreach=False) for p in model.parameters()}

    def step(p: nn.Parameter) -> None:
        steps[p].step()
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    hand = Hand(model, optimizer=None)
    hand.counted = Held(steps)
    return hand


class Held:
    """The per-parameter optimizers' state, as one optimizer's for the tracker to count; nothing to step."""

    def __init__(self, steps: dict[nn.Parameter, torch.optim.Optimizer]) -> None:
        self.steps, self.hooks = steps, OrderedDict()

    @property
    def state(self) -> dict[nn.Parameter, dict]:
        return {p: o.state[p] for p, o in self.steps.items() if p in o.state}

    def register_step_pre_hook(self, hook: Callable) -> RemovableHandle:
        return RemovableHandle(self.hooks)  # never called: no step runs after backward


CNN = {"channels-last"}  # cases on resnet-tiny: the rest run on vit-tiny
CASES: dict[str, tuple[tuple[TechniqueSpec, ...], Callable[[nn.Module], Hand]]] = {
    "baseline": ((), Hand),
    "bf16": ((TechniqueSpec("bf16"),), lambda m: Hand(m, dtype=torch.bfloat16)),
    "amp-bf16": ((TechniqueSpec("amp"),), lambda m: Hand(m, autocast=True)),
    "accumulate-2": ((TechniqueSpec("accumulate", (("micro_batches", 2),)),), lambda m: Hand(m, micro=2)),
    "checkpoint": ((TechniqueSpec("checkpoint"),), checkpointed),
    "checkpoint-every-2": ((TechniqueSpec("checkpoint", (("every", 2),)),), lambda m: checkpointed(m, every=2)),
    "selective-checkpoint": ((TechniqueSpec("selective-checkpoint"),), lambda m: checkpointed(m, selective=True)),
    "accumulate-4": ((TechniqueSpec("accumulate", (("micro_batches", 4),)),), lambda m: Hand(m, micro=4)),
    "adafactor": ((TechniqueSpec("optimizer", (("kind", "adafactor"), ("lr", 0.01))),),
                  lambda m: Hand(m, torch.optim.Adafactor, lr=0.01)),
    "zero-grad-keep": ((TechniqueSpec("zero-grad-keep"),), lambda m: Hand(m, keep_grads=True)),
    "channels-last": ((TechniqueSpec("channels-last"),), lambda m: Hand(m, layout=torch.channels_last)),
    "optimizer-in-backward": ((TechniqueSpec("optimizer-in-backward"),), in_backward),
    "sgd-momentum": ((TechniqueSpec("optimizer", (("kind", "sgd"), ("lr", 0.01))),),
                     lambda m: Hand(m, torch.optim.SGD, lr=0.01, momentum=0.9)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_harness_holds_what_a_hand_written_loop_doing_the_same_holds(name):
    techniques, make = CASES[name]
    model = "resnet-tiny" if name in CNN else "vit-tiny"
    trainer, batch = build_trainer(spec(model, techniques, batch_size=8, image_size=32))
    hand = make(build_trainer(spec(model, batch_size=8, image_size=32))[0].model)
    for _ in range(2):  # warm-up both, optimizer state included
        trainer.step(clone_batch(batch))
        hand.step([clone_batch(batch)])
    ours = tracked_step(lambda: trainer.step(clone_batch(batch)), trainer.model, trainer.optimizer, CPU)
    theirs = tracked_step(lambda: hand.step([clone_batch(batch)]), hand.model, hand.counted, CPU)
    assert ours["peak_tensor_bytes"] == theirs["peak_tensor_bytes"], (ours, theirs)
