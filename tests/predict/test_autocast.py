"""CUDA's autocast on fake CPU tensors, held against CUDA's own autocast kernels: this torch
registers them without a GPU, and they run forward on fake CUDA tensors (backward would need a CUDA
context)."""

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.models import convnext_tiny

from bench.predict import autocast
from bench.techniques import Unsupported

BF16, F32 = torch.bfloat16, torch.float32


@contextmanager
def autocast_on(device: str) -> Iterator[None]:
    """bfloat16 autocast for ``device``, set directly: ``torch.autocast("cuda")`` turns itself off
    without a GPU."""
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, BF16)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, False)
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


def on(device: str, call, emulate: bool = False):
    """``call(make)`` under bf16 autocast on fake ``device`` tensors; ``make(shape, dtype)`` makes
    an input."""
    with (
        FakeTensorMode(),
        autocast.cuda_autocast() if emulate else nullcontext(),
        autocast_on(device),
    ):
        return call(
            lambda *shape, dtype=F32: torch.empty(
                shape, dtype=dtype, device=device, requires_grad=True
            )
        )


def test_every_op_cudas_autocast_registers_has_a_rule():
    registered = autocast._registered("AutocastCUDA")
    assert {
        name for name in registered if autocast._kernel(name, autocast._Casts()) is None
    } == set()


def test_every_rule_names_an_op_cudas_autocast_registers():
    """Up to the two ops CUDA's lists gained after torch 2.11, the CUDA host's (a misspelt name
    would show)."""
    ruled = {
        *autocast.LOWER,
        *autocast.FP32,
        *autocast.FP32_DTYPE,
        *autocast.PROMOTE,
        *autocast.BANNED,
        *map(autocast._base, autocast.FP32_APPEND),
    }
    assert ruled - set(map(autocast._base, autocast._registered("AutocastCUDA"))) <= {
        "rms_norm",
        "linalg_matrix_sqrth",
    }


CALLS = {  # one op or more of each rule, and ops only CPU's autocast casts
    "layer_norm": lambda t: F.layer_norm(t(4, 8, dtype=BF16), (8,), t(8), t(8)),
    "exp, pow": lambda t: (t(4, dtype=BF16).exp(), t(4, dtype=BF16).pow(2)),
    "softmax, sum": lambda t: (
        F.softmax(t(4, 8, dtype=BF16), -1),
        t(4, dtype=BF16).sum(),
        t(4, 2, dtype=BF16).sum(1),
    ),
    "sum with a dtype": lambda t: t(4, dtype=BF16).sum(dtype=BF16),
    "norm": lambda t: (t(4, dtype=BF16).norm(), t(4, 2, dtype=BF16).norm(2, 1)),
    "einsum, mv": lambda t: (torch.einsum("ij,jk->ik", t(4, 8), t(8, 2)), torch.mv(t(4, 8), t(8))),
    "linear, conv": lambda t: (F.linear(t(4, 8), t(2, 8)), F.conv2d(t(1, 3, 8, 8), t(4, 3, 3, 3))),
    "addcmul": lambda t: torch.addcmul(t(4, dtype=BF16), t(4), t(4, dtype=BF16)),
    # CPU's own rule, not CUDA's
    "cross_entropy": lambda t: F.cross_entropy(t(4, 10, dtype=BF16), t(4, 10)),
    "avg_pool3d, stack": lambda t: (
        F.avg_pool3d(t(1, 2, 4, 4, 4, dtype=BF16), 2),
        torch.stack([t(2), t(2, dtype=BF16)]),
    ),
}


def dtypes(out) -> list[torch.dtype]:
    return [o.dtype for o in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_each_rule_gives_what_cudas_own_kernel_gives(call):
    assert dtypes(on("cpu", call, emulate=True)) == dtypes(on("cuda", call))


def test_cpus_own_lists_give_other_dtypes_for_most_of_these_ops():
    """The difference the rules are there for (mv in float32, layer norm or sum in 16 bits,
    avg_pool3d in float32 on a CPU), and the ops where CPU's lists already agree with CUDA's."""
    differ = {
        name for name, call in CALLS.items() if dtypes(on("cpu", call)) != dtypes(on("cuda", call))
    }
    assert differ == {
        "layer_norm",
        "exp, pow",
        "softmax, sum",
        "norm",
        "einsum, mv",
        "avg_pool3d, stack",
    }


def test_an_op_cudas_autocast_refuses_is_unsupported():
    bce = lambda t: F.binary_cross_entropy(t(4, dtype=BF16).sigmoid(), t(4, dtype=BF16))  # noqa: E731
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        on("cuda", bce)
    with pytest.raises(Unsupported, match="refuses binary_cross_entropy"):
        on("cpu", bce, emulate=True)


class CountingCasts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def test_a_weight_is_cast_once_per_autocast_region():
    def twice(t):
        x, y, w = t(2, 8), t(3, 8), t(8, 4)
        with CountingCasts() as counted:
            torch.einsum("ij,jk->ik", x, w), torch.einsum("ij,jk->ik", y, w)
        return counted.casts

    assert on("cpu", twice, emulate=True) == on("cuda", twice) == 3  # x, y and w once


def saved_for_backward(device: str, emulate: bool = False) -> Counter:
    """(shape, dtype) of every tensor ConvNeXt-T's forward saves for backward under bf16
    autocast."""
    kept = Counter()

    def forward(t):
        with torch.device("meta"):
            model = convnext_tiny(num_classes=10)
        for module in model.modules():
            for name, p in module._parameters.items():
                module._parameters[name] = torch.nn.Parameter(t(*p.shape).detach())
        with torch.autograd.graph.saved_tensors_hooks(
            lambda s: kept.update([(tuple(s.shape), s.dtype)]) or s, lambda s: s
        ):
            model(t(2, 3, 32, 32))

    on(device, forward, emulate)
    return kept


def test_convnext_keeps_for_backward_what_cudas_autocast_keeps():
    """ConvNeXt's layer norms take a 16-bit convolution's output. CUDA's autocast runs them in
    float32, so each keeps a float32 copy of its input (and float32 statistics) where CPU's would
    keep the 16-bit input."""
    cuda = saved_for_backward("cuda")
    assert saved_for_backward("cpu", emulate=True) == cuda
    cpu = saved_for_backward("cpu")
    # channels last at 32 px: the stem's layer norm and the first stage's three blocks'
    stage_1 = (2, 8, 8, 96)
    assert (cuda - cpu)[(stage_1, F32)] == (cpu - cuda)[(stage_1, BF16)] == 4
