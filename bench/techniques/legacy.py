"""What an older PyTorch kept that today's does not, so a suite can say which stack its published
figures ran under (the Hugging Face table of January 2022 ran PyTorch 1.10). Each reproduces that
release's behaviour from its source; none saves memory."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from bench.techniques.base import TECHNIQUES, RunContext, Step, Technique, Unsupported

# Where each softmax entry point takes its dtype when given by position.
SOFTMAXES = {
    torch.nn.functional.softmax: 3,
    torch.softmax: 2,
    torch.Tensor.softmax: 2,
    torch.special.softmax: 2,
}


class _KeepsInput(torch.autograd.Function):
    """Softmax as PyTorch 1.10's autograd recorded it. Its backward uses the output alone, but its
    formula then named the input too (``self: _softmax_backward_data(grad, result, dim, self)``), so
    both were saved until backward reached it; pytorch#66018 (October 2021, first released in 1.11)
    saved the input's dtype instead."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        y = torch._softmax(x, dim, False)
        ctx.save_for_backward(x, y)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, y = ctx.saved_tensors
        return torch._softmax_backward_data(grad, y, ctx.dim, x.dtype), None


class _Softmaxes(TorchFunctionMode):
    """Routes each softmax that records a graph through ``_KeepsInput``, counting them."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in SOFTMAXES and torch.is_grad_enabled():
            if args:
                x = args[0]
            else:
                x = kwargs.get("input")
            if len(args) > 1:
                dim = args[1]
            else:
                dim = kwargs.get("dim")
            if len(args) > SOFTMAXES[func]:
                dtype = args[SOFTMAXES[func]]
            else:
                dtype = kwargs.get("dtype")
            if isinstance(x, torch.Tensor) and x.requires_grad and dim is not None:
                self.kept += 1
                return _KeepsInput.apply(_as_softmax_takes(x, dtype), dim)
        return func(*args, **kwargs)


def _as_softmax_takes(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor softmax's kernel receives, which 1.10 saved: cast to ``dtype`` where given, else
    as autocast casts softmax's input on this device (CUDA's lists run it in float32, CPU's as
    given; an empty tensor asks the dispatcher, so the rule is the one in force)."""
    if dtype is None:
        dtype = torch.softmax(x.new_empty(0), -1).dtype
    return x.to(dtype)


@TECHNIQUES.register("softmax-keeps-input")
class SoftmaxKeepsInput(Technique):
    """Softmax as PyTorch 1.10 and earlier trained it: its backward kept its input as well as its
    output.

    Expected: one more tensor of the attention scores' size per eager attention layer until backward
    reaches it (bert-large at 4 × 512 in float32: 64 MiB a layer, 1.5 GiB in all); none with
    checkpointing beyond the layer recomputed. For holding a prediction to figures measured under
    PyTorch ≤ 1.10 (the ``hf-bert-large-2022`` suite). Accuracy: identical.
    """

    not_advised = (
        "reproduces an older PyTorch's softmax, which kept its input for backward: never saves "
        "memory"
    )
    summary = "softmax keeping its input for backward, as PyTorch ≤ 1.10 did"
    # the mode is entered from module hooks, which a compiled graph skips
    conflicts = frozenset({"compile"})

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        # Every module's call, not only the model's: checkpointing recomputes a layer from backward,
        # outside the step's forward, and 1.10 kept the input there too.
        self.mode, self.depth = _Softmaxes(), 0
        for module in model.modules():
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._leave, always_call=True)
        return model

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.depth == 0:
            self.mode.__enter__()
        self.depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.mode.__exit__(None, None, None)

    def step(self) -> Step:
        return Step(after=self._check)

    def _check(self) -> None:
        if not self.mode.kept:
            raise Unsupported(
                "no softmax of this model's step recorded a gradient: its attention is a fused "
                "kernel (SDPA), which PyTorch 1.10 did not have; build it with "
                "attn_implementation=eager"
            )

    def proof(self, steps: int) -> dict[str, Any]:
        return {"softmaxes_keeping_input_per_step": self.mode.kept // steps if steps else 0}
