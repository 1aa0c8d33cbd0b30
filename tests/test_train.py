"""The harness's training step holds exactly what a hand-written loop doing the same thing holds:
its tracked peak equals the hand loop's to the byte, technique by technique (anything the harness
added would be reported as the technique's own)."""

from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.hooks import RemovableHandle

from bench.data.synthetic import clone_batch
from bench.measure.memory import tracked_step
from bench.suite import TechniqueSpec
from bench.techniques.loss import _ChunkedCrossEntropy, chunk_tokens
from tests.conftest import CPU, build_trainer
from tests.helpers import spec


class Hand:
    """A hand-written loop: ``model`` with an ``optimizer``, the batch cast to ``dtype``, split in
    ``micro`` micro-batches, under bf16 autocast where asked."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: type | None = torch.optim.AdamW,
        dtype: torch.dtype | None = None,
        micro: int = 1,
        autocast: bool = False,
        keep_grads: bool = False,
        layout: torch.memory_format = torch.contiguous_format,
        **options: float,
    ) -> None:
        self.model = (model.to(dtype) if dtype else model).to(memory_format=layout)
        self.optimizer = (
            optimizer(self.model.parameters(), **({"lr": 1e-3} | options)) if optimizer else None
        )
        self.dtype, self.micro, self.autocast, self.keep_grads = dtype, micro, autocast, keep_grads
        self.layout = layout
        self.counted: object = self.optimizer  # what the tracker counts as optimizer state
        self.forward: nn.Module = self.model  # the module whose forward the loop calls

    def step(self, batch: list) -> torch.Tensor:
        """One step; the mean loss, summed over the micro-batches as a loop that logs it does."""
        # the caller keeps no reference: a cast frees the batch as it came
        inputs, labels = batch.pop()
        if isinstance(inputs, dict):
            # a language model's token ids: nothing to cast, lay out or split
            pieces = [(inputs, labels)]
        else:
            if self.dtype:
                inputs = inputs.to(self.dtype)
            inputs = inputs.contiguous(memory_format=self.layout)
            pieces = zip(inputs.tensor_split(self.micro), labels.tensor_split(self.micro))
        total = None
        for x, y in pieces:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss = self.loss(x, y) / self.micro
            total = loss.detach() if total is None else total + loss.detach()
            loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        return total

    def loss(self, x: torch.Tensor | dict, y: torch.Tensor) -> torch.Tensor:
        if isinstance(x, dict):  # transformers' causal-LM loss: the labels shifted, not the logits
            logits = self.model(**x).logits
            return nn.functional.cross_entropy(
                logits.flatten(0, 1), following(y).flatten(), ignore_index=-100
            )
        return nn.functional.cross_entropy(self.model(x), y)


def following(ids: torch.Tensor) -> torch.Tensor:
    """Each position's target: the next token, -100 (ignored) after the last."""
    return nn.functional.pad(ids[:, 1:], (0, 1), value=-100)


class LigerStyle(Hand):
    """A loop that takes the loss from the last hidden states a chunk at a time, as a user calls
    Liger-Kernel's fused linear cross-entropy (its plain-PyTorch twin here): the head never runs on
    the whole sequence."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        # the decoder; its head is tied to the embeddings, so no parameter is missed
        self.forward = model.model

    def loss(self, x: dict, y: torch.Tensor) -> torch.Tensor:
        hidden = self.model.model(**x).last_hidden_state.flatten(0, 1)
        head, targets = self.model.lm_head, following(y).flatten()
        return _ChunkedCrossEntropy.apply(
            hidden, head.weight, head.bias, targets, chunk_tokens(len(targets), *head.weight.shape)
        )


def galore(model: nn.Module) -> Hand:
    """pytorch-optimizer's GaLore as its README groups it: the blocks' weight matrices projected at
    a quarter of their smaller side, everything else plain AdamW."""
    from pytorch_optimizer import GaLore

    blocks = {id(p) for p in model.encoder.layers.parameters()}
    projected = [p for p in model.parameters() if p.dim() == 2 and id(p) in blocks]
    rest = [p for p in model.parameters() if id(p) not in {id(q) for q in projected}]
    hand = Hand(model, optimizer=None)
    ranks = sorted({min(p.shape) // 4 for p in projected})
    groups = [{"params": rest}] + [
        {
            "params": [p for p in projected if min(p.shape) // 4 == r],
            "rank": r,
            "update_proj_gap": 200,
            "scale": 0.25,
            "projection_type": "std",
        }
        for r in ranks
    ]
    hand.optimizer = hand.counted = GaLore(groups, lr=1e-3)
    return hand


def adamw_8bit(model: nn.Module) -> Hand:
    from torchao.optim import AdamW8bit

    return Hand(model, AdamW8bit)


class Checkpointed(nn.Module):
    def __init__(
        self, block: nn.Module, selective: bool = False, policy: Callable | None = None
    ) -> None:
        super().__init__()
        # a factory
        self.block, self.policy = block, policy or ((lambda: keep_matmuls) if selective else None)

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if self.policy:
            # PyTorch's documented recipe: keep what the policy says, recompute the rest
            return checkpoint(
                self.block,
                x,
                *args,
                use_reentrant=False,
                **kwargs,
                context_fn=lambda: create_selective_checkpoint_contexts(self.policy()),
            )
        return checkpoint(self.block, x, *args, use_reentrant=False, **kwargs)


def torchtitan_policy() -> Callable:
    """torchtitan's op policy for one checkpointed call: attention saved, and every other matmul."""
    aten, count = torch.ops.aten, {False: 0, True: 0}
    attention = {
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
    }

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        if op == aten.mm.default:
            count[ctx.is_recompute] += 1
            keep = count[ctx.is_recompute] % 2 == 1
        else:
            keep = op in attention or op == aten.max.default
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def llama_checkpointed(model: nn.Module) -> Hand:
    layers = model.model.layers  # transformers' decoder layers
    for name, block in list(layers.named_children()):
        setattr(layers, name, Checkpointed(block, policy=torchtitan_policy))
    return Hand(model)


def keep_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    aten = torch.ops.aten
    matmuls = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default)
    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(model: nn.Module, every: int = 1, selective: bool = False) -> Hand:
    layers = model.encoder.layers  # torchvision's ViT blocks
    for name, block in list(layers.named_children())[::every]:
        setattr(layers, name, Checkpointed(block, selective))
    return Hand(model)


def in_backward(model: nn.Module, eight_bit: bool = False) -> Hand:
    """PyTorch's optimizer_step_in_backward tutorial: an AdamW per parameter, stepped from its
    gradient's hook (bitsandbytes' 8-bit AdamW, with ``eight_bit``)."""
    if eight_bit:
        from bitsandbytes.optim import AdamW8bit, GlobalOptimManager

        # as a process of its own holds it: no override another test's optimizer registered (an
        # embedding's 32 bits), which bitsandbytes would key to every one's first parameter
        GlobalOptimManager.get_instance().initialize()
        steps = {p: AdamW8bit([p], lr=1e-3) for p in model.parameters()}
    else:
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
    """The per-parameter optimizers' state, as one optimizer's for the tracker to count; nothing to
    step."""

    def __init__(self, steps: dict[nn.Parameter, torch.optim.Optimizer]) -> None:
        self.steps, self.hooks = steps, OrderedDict()

    @property
    def state(self) -> dict[nn.Parameter, dict]:
        return {p: o.state[p] for p, o in self.steps.items() if p in o.state}

    def register_step_pre_hook(self, hook: Callable) -> RemovableHandle:
        return RemovableHandle(self.hooks)  # never called: no step runs after backward


CNN = {"channels-last"}  # cases on resnet-tiny
# on llama-tiny: the rest run on vit-tiny
LM = {
    "llm-baseline",
    "chunked-loss",
    "selective-torchtitan",
}
# torchao compiles each parameter's update: the tracker steps aside, as for a run
COMPILED = {"adamw-8bit"}
CASES: dict[str, tuple[tuple[TechniqueSpec, ...], Callable[[nn.Module], Hand]]] = {
    "baseline": ((), Hand),
    "bf16": ((TechniqueSpec("bf16"),), lambda m: Hand(m, dtype=torch.bfloat16)),
    "amp-bf16": ((TechniqueSpec("amp"),), lambda m: Hand(m, autocast=True)),
    "accumulate-2": (
        (TechniqueSpec("accumulate", (("micro_batches", 2),)),),
        lambda m: Hand(m, micro=2),
    ),
    "checkpoint": ((TechniqueSpec("checkpoint"),), checkpointed),
    "checkpoint-every-2": (
        (TechniqueSpec("checkpoint", (("every", 2),)),),
        lambda m: checkpointed(m, every=2),
    ),
    "selective-checkpoint": (
        (TechniqueSpec("selective-checkpoint"),),
        lambda m: checkpointed(m, selective=True),
    ),
    "accumulate-4": (
        (TechniqueSpec("accumulate", (("micro_batches", 4),)),),
        lambda m: Hand(m, micro=4),
    ),
    "adafactor": (
        (TechniqueSpec("optimizer", (("kind", "adafactor"), ("lr", 0.01))),),
        lambda m: Hand(m, torch.optim.Adafactor, lr=0.01),
    ),
    "zero-grad-keep": ((TechniqueSpec("zero-grad-keep"),), lambda m: Hand(m, keep_grads=True)),
    "channels-last": (
        (TechniqueSpec("channels-last"),),
        lambda m: Hand(m, layout=torch.channels_last),
    ),
    "optimizer-in-backward": ((TechniqueSpec("optimizer-in-backward"),), in_backward),
    "optimizer-in-backward-8bit": (
        (TechniqueSpec("optimizer-in-backward", (("optimizer", "adamw-8bit"),)),),
        lambda m: in_backward(m, eight_bit=True),
    ),
    "sgd-momentum": (
        (TechniqueSpec("optimizer", (("kind", "sgd"), ("lr", 0.01))),),
        lambda m: Hand(m, torch.optim.SGD, lr=0.01, momentum=0.9),
    ),
    "adamw-8bit": ((TechniqueSpec("adamw-8bit"),), adamw_8bit),
    "galore": ((TechniqueSpec("galore"),), galore),
    "llm-baseline": ((), Hand),
    "chunked-loss": ((TechniqueSpec("chunked-loss"),), LigerStyle),
    "selective-torchtitan": (
        (TechniqueSpec("selective-checkpoint", (("save", "torchtitan"),)),),
        llama_checkpointed,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_harness_holds_what_a_hand_written_loop_doing_the_same_holds(name):
    techniques, make = CASES[name]
    model = "resnet-tiny" if name in CNN else "llama-tiny" if name in LM else "vit-tiny"
    trainer, batch = build_trainer(spec(model, techniques, batch_size=8, image_size=32, seq_len=64))
    hand = make(build_trainer(spec(model, batch_size=8, image_size=32, seq_len=64))[0].model)
    for _ in range(2):  # warm-up both, optimizer state included
        trainer.step(clone_batch(batch))
        hand.step([clone_batch(batch)])
    compiled = name in COMPILED
    ours = tracked_step(
        lambda: trainer.step(clone_batch(batch)),
        trainer.model,
        trainer.optimizer,
        CPU,
        compiled_update=compiled,
    )
    theirs = tracked_step(
        lambda: hand.step([clone_batch(batch)]),
        hand.forward,
        hand.counted,
        CPU,
        compiled_update=compiled,
    )
    assert ours.peak_tensor_bytes == theirs.peak_tensor_bytes, (ours, theirs)
