"""What makes fake tensors behave as the real run's tensors where that changes what is counted:
values read, kernels' outputs, copies and conversions, and the few techniques whose real behaviour
needs values (a GradScaler's overflow check) or real memory behind them (save_on_cpu's host copies).
A technique names the stand-ins it needs (``Technique.stand_ins``); the built-in techniques' live
here."""

from __future__ import annotations

import functools
import inspect
import pkgutil
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, NamedTuple
from unittest.mock import patch

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from bench.measure.host import (
    host_copy,
    is_on_host,
    making_host,
    making_unified,
    marked_pinned,
    on_host,
)
from bench.measure.tracker import DEVICE, device_of
from bench.techniques import Technique

aten = torch.ops.aten


@contextmanager
def techniques_as_real(techniques: list[Technique], cuda: bool) -> Iterator[None]:
    """The library calls the run's techniques declare fake tensors cannot run
    (``Technique.stand_ins``), each replaced by its stand-in, which makes the same tensors; for
    ``cuda``, those whose CUDA kernels keep other tensors too (``Technique.cuda_stand_ins``)."""
    declared = {
        target: using
        for t in techniques
        for target, using in (t.stand_ins | (t.cuda_stand_ins if cuda else {})).items()
    }
    with ExitStack() as stack:
        for target, using in declared.items():
            module, _, path = target.partition(":")
            owner_path, _, name = path.rpartition(".")
            owner = pkgutil.resolve_name(f"{module}:{owner_path}" if owner_path else module)
            replacement = pkgutil.resolve_name(using)
            if getattr(replacement, "wraps_original", False):
                replacement = replacement(getattr(owner, name))
            if isinstance(inspect.getattr_static(owner, name), staticmethod):
                replacement = staticmethod(replacement)
            stack.enter_context(patch.object(owner, name, replacement))
        yield


def fake_host_optimizer() -> type[torch.optim.Optimizer]:
    """``cpu-offload-optimizer``'s host optimizer, for fake tensors."""
    return FakeCPUOffloadOptimizer


# bitsandbytes.optim.optimizer.Optimizer8bit.get_state_buffer: `p.numel() < 1e5` stay
PAGED_FROM = 100_000


def paged_buffer(self: Any, p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bitsandbytes' ``get_state_buffer`` as on CUDA: a paged optimizer's state of a parameter of
    100,000 elements or more is unified memory wrapped in a host tensor, which the device's
    allocator never holds (on fake CPU tensors bitsandbytes would take its CPU fallback, an ordinary
    tensor)."""
    return _state(self, p, lambda: torch.zeros_like(p, dtype=dtype))


def paged_double_buffer(
    self: Any, p: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """bitsandbytes AdEMAMix's ``_get_state_double_buffer`` as on CUDA: its fast and slow first
    moments in one buffer twice the parameter's size, paged as ``paged_buffer``'s are."""
    return _state(self, p, lambda: torch.zeros((2, *p.size()), dtype=dtype))


def _state(self: Any, p: torch.Tensor, made: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A bitsandbytes optimizer's state buffer for ``p``, ``made``; paged (unified memory) where
    the optimizer pages and ``p`` has PAGED_FROM elements or more."""
    if not (self.is_paged and p.numel() >= PAGED_FROM):
        return made()
    with making_unified():  # never the allocator's, in the step that makes it either
        buffer = made()
    # (bench.measure.host.is_unified) not is_paged, bitsandbytes' own mark: it would prefetch the
    # pages, which a fake tensor has not
    buffer.unified_memory = True
    return buffer


class FakeOverlappedSaves(torch.autograd.graph.saved_tensors_hooks):
    """``activation-offload``'s hooks for fake tensors, which have no streams: a saved tensor of
    ``min_bytes`` or more is copied into pinned host memory as it is packed (its device block is
    free once the copy is done, which is taken to be before the allocator needs it again); each
    unpack makes its device copy, and the copy of the tensor saved before it, fetched one ahead,
    lives until that one is unpacked. A host copy is freed once fetched, its pinned block cached
    for the next."""

    def __init__(self, owner: Any) -> None:
        self.owner, self.count = owner, 0
        self.host: dict[int, torch.Tensor] = {}
        self.fetched: dict[int, torch.Tensor] = {}

        def pack(t: torch.Tensor) -> Any:
            if is_on_host(t) or t.nbytes < owner.config.min_bytes or isinstance(t, nn.Parameter):
                return t
            key, self.count = self.count, self.count + 1
            self.host[key] = host_copy(t, pinned=True)
            owner.offloaded += 1
            return key

        def unpack(packed: Any) -> torch.Tensor:
            if not isinstance(packed, int):
                return packed
            device = self.fetched.pop(packed, None)
            if device is None:
                device = self._fetch(packed)
            if packed - 1 in self.host:
                self.fetched[packed - 1] = self._fetch(packed - 1)
                owner.prefetched += 1
            return device

        super().__init__(pack, unpack)

    def _fetch(self, key: int) -> torch.Tensor:
        host = self.host.pop(key)
        return torch.empty(host.shape, dtype=host.dtype)


class FakeCPUOffloadOptimizer:
    """torchao's CPUOffloadOptimizer (``cpu-offload-optimizer``) for fake tensors, which it cannot
    take (it pins host memory and runs CUDA streams). The same placement: each parameter of 4,096
    elements or more has a host copy and a host gradient, its own AdamW stepping on the host, its
    state marked as host memory; backward copies each gradient into the host one as it is made, and
    frees the device's with ``offload_gradients``; the new values are copied back in place. Smaller
    parameters keep an AdamW on the device."""

    def __init__(
        self,
        params: Any,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        offload_gradients: bool = False,
        minimal_size: int = 4096,
        **kwargs: Any,
    ) -> None:
        params = [p for p in params if p.requires_grad]
        kept = [p for p in params if p.numel() < minimal_size]
        self.param_d2h_map, self.optim_dict = {}, {}
        for p in params:
            if p.numel() >= minimal_size:  # pinned, as torchao pins them
                host = host_copy(p, pinned=True)
                host.grad = host_copy(p, pinned=True)
                self.param_d2h_map[p] = host
                self.optim_dict[p] = optimizer_class([host], fused=True, **kwargs)
                p.register_post_accumulate_grad_hook(self._to_host(offload_gradients))
        if kept:
            self.d_param_groups = [{"params": kept}]
        else:
            self.d_param_groups = []
        if kept:
            self.d_opt = optimizer_class(kept, **kwargs)
        else:
            self.d_opt = None

    def _to_host(self, free: bool) -> Any:
        def copy(p: torch.Tensor) -> None:
            self.param_d2h_map[p].grad.copy_(p.grad)
            if free:
                p.grad = None

        return copy

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if self.d_opt is not None:
            self.d_opt.step()
        for p, host in self.param_d2h_map.items():
            with making_host(pinned=False):  # its state: pageable, made by the host's AdamW
                self.optim_dict[p].step()
            for value in self.optim_dict[p].state[host].values():
                on_host(value)
            p.copy_(host)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_d2h_map:
            p.grad = None
        if self.d_opt is not None:
            self.d_opt.zero_grad(set_to_none)


class _Packed(NamedTuple):
    """A saved tensor as ``FakeSaveOnCpu`` keeps it: its host copy, or the host tensor itself."""

    tensor: torch.Tensor
    copied: bool


class FakeSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """``save_on_cpu`` for fake tensors standing for CUDA ones (the ``offload`` technique): a saved
    tensor is copied into host memory, pinned or pageable as asked, and unpacking it makes the
    device copy that save_on_cpu's ``.to(device)`` makes, contiguous as the pinned copy is; one
    standing for a host tensor stays as it is, as on CUDA, where it never reaches the device."""

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        def pack(t: torch.Tensor) -> _Packed:
            if is_on_host(t):
                return _Packed(t, copied=False)
            return _Packed(host_copy(t, pin_memory), copied=True)

        def unpack(packed: _Packed) -> torch.Tensor:
            if not packed.copied:
                return packed.tensor
            return torch.empty(packed.tensor.shape, dtype=packed.tensor.dtype)

        super().__init__(pack, unpack)


def left_eager(model: nn.Module, mode: str) -> None:
    """``compile``'s call for fake tensors: dynamo cannot trace the fake step, and the prediction
    gives the eager step's figures, saying so (``Technique.approximate``)."""


def every_position_a_target(count: torch.Tensor, valid: torch.Tensor) -> int:
    """``sft-chunked-nll``'s count of positions with a target, which fake tensors cannot read: every
    position of the harness's data has one (its rows are whole sequences, no padding)."""
    return valid.numel()


# Set while a healthy step's checks run (``healthy``): every value they read off a tensor reads as 0
# (False): no gradient is inf or NaN, no norm is invalid.
HEALTHY: list[bool] = []


def healthy(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a check for overflow) as a healthy step runs it: its tensors made, every value
    it reads read as 0, as in the real run, where no gradient overflows (read as 1, every step would
    be skipped and the optimizer's state never made). A stand-in that wraps what it stands in for
    (``wraps_original``)."""

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        HEALTHY.append(True)
        try:
            return original(*args, **kwargs)
        finally:
            HEALTHY.pop()

    return run


healthy.wraps_original = True  # type: ignore[attr-defined]


class ScalerWithoutValues:
    """A GradScaler (``amp`` with float16) for fake tensors: its overflow check reads values, which
    read as 1, so the real one would take every step for an overflow and skip the optimizer (whose
    state would then go uncounted). The scaled loss is a tensor of its own, alive through backward
    as the real one's is (the H100 records' peaks in backward held its 512-byte block); the scaler's
    own scalars are not counted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * 1.0  # the real one multiplies by its scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # the real one divides the gradients in place, beside its own scalars

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass

    def get_scale(self) -> float:
        return 1.0


# the integer and bool tensors whose values a prediction keeps beside their fakes, up to this many
# elements (a batch's masks and positions; not a long context's 4-D masks)
KEPT_NUMEL = 1 << 22
# operators whose output's shape is read off their input's values
VALUE_SHAPED = frozenset(
    {aten.nonzero.default, aten.masked_select.default, aten.repeat_interleave.Tensor}
)
# operators that make memory without values: what is written into it later decides them
UNINITIALISED = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)


class ScalarsRead(TorchDispatchMode):
    """Fake tensors hold no values, so reading one (``.item()``, ``bool()``) fails. A batch's
    integer tensors are made from real values (its ids, its attention mask, its lengths), and what
    is computed from them alone (the mask's check for padding, positions, a padded batch's
    unpadding) is computed on those values too, beside the fakes: such a read is the real run's,
    and an operator whose output's shape follows values (``nonzero``) gets the real shape. Any other
    value read (a norm Adafactor scales by) reads as 1: memory does not depend on it. Under
    ``inference_mode`` a read reaches this mode undecomposed, as ``item`` or ``is_nonzero``."""

    READS = (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default)

    def __init__(
        self,
        fake_mode: torch._subclasses.fake_tensor.FakeTensorMode,
        outputs: Callable[[Any, tuple, dict], Any] | None = None,
    ) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.values = WeakTensorKeyDictionary()
        # each operator is run by ``outputs`` (OutputsAsReal): one mode, not two, between the
        # tracker and the fakes, each mode a Python call more on every operator a step runs
        self.outputs = outputs or _called

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE:
            return device_of(args[0])
        kwargs = kwargs or {}
        if func in self.READS:
            known = self._value(args[0])
            if known is not None:
                with _disable_current_modes():
                    return func(known)
            if args[0].dtype == torch.bool or func is aten.is_nonzero.default:
                return not HEALTHY
            return 0 if HEALTHY else 1
        reals = self._reals(args, kwargs)
        if func in VALUE_SHAPED and reals is not None:
            with _disable_current_modes():
                found = func(*reals[0], **reals[1])
            out = self.fake_mode.from_tensor(found)
            self.values[out] = found
            return out
        out = self.outputs(func, args, kwargs)
        self._keep(func, (args, kwargs), reals, out)
        return out

    def _value(self, t: object) -> torch.Tensor | None:
        if not isinstance(t, torch.Tensor):
            return None
        if not isinstance(t, FakeTensor):  # a real tensor (a dataset's sequence): its own values
            return t if t.device.type == "cpu" else None
        return self.values.get(t)

    def _reals(self, args: tuple, kwargs: dict) -> tuple[list, dict] | None:
        """The arguments with each tensor's values, None where one's are not known."""
        for a in args:  # most operators take a fake whose values are not known first: said at once
            first = a[0] if isinstance(a, list | tuple) and a else a
            if isinstance(first, FakeTensor) and first not in self.values:
                return None
        flat, spec = tree_flatten((list(args), kwargs))
        out = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                a = self._value(a)
                if a is None:
                    return None
            out.append(a)
        return tree_unflatten(out, spec)

    def _keep(self, func: Any, called: tuple, reals: tuple | None, out: Any) -> None:
        """The values of ``out``'s integer and bool tensors, where every input's are known; an
        input written with values not known forgets its own."""
        written = [a for a in _written(func, called) if isinstance(a, FakeTensor)]
        if reals is None or func in UNINITIALISED:
            for t in written:
                self.values.pop(t, None)
                if t._base is not None:
                    self.values.pop(t._base, None)
            return
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        wanted = [t for t in outs if _kept(t)]
        if not wanted and not any(t in self.values for t in written):
            return
        with _disable_current_modes():
            found = func(*reals[0], **reals[1])
        for fake, real in zip(outs, [t for t in tree_leaves(found) if isinstance(t, torch.Tensor)]):
            if _kept(fake):
                self.values[fake] = real


def _kept(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor) and not t.is_floating_point() and t.numel() <= KEPT_NUMEL


def _written(func: Any, called: tuple) -> list[Any]:
    """The arguments an operator writes into (its schema's mutable ones)."""
    args, kwargs = called
    return [
        args[i] if i < len(args) and not only else kwargs.get(name)
        for i, name, only in _mutable(func)
    ]


@functools.cache
def _mutable(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """An operator's arguments it writes into: (place, name, keyword only) of each."""
    return tuple(
        (i, arg.name, arg.kwarg_only)
        for i, arg in enumerate(func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def _called(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


# pinning host memory, which fake tensors cannot: the pinned copy made as a tensor standing for it
PINNING = frozenset({aten._pin_memory.default, aten.is_pinned.default})


class OutputsAsReal:
    """Each operator's outputs as the real kernels return them (called by ``ScalarsRead`` for the
    fakes' own), where the meta kernels fake tensors run differ in
    what is counted. The mean and inverse std a norm saves for backward, in the real kernel's dtype
    where the meta kernel gives the input's. Batch norm on a CPU: the weight's (float32 under
    autocast). On CUDA (``cuda``) the input's accumulation type, float32 for 16-bit inputs: cuDNN
    takes them only with float32 weights, and saves in the weight's dtype, and CUDA's own kernel,
    which takes 16-bit weights, saves in the accumulation type (pure bf16 ResNet-50 on the H100: 196
    blocks more than the weight's dtype). Layer norm on CUDA: float32 for 16-bit inputs, its
    accumulation type, where CPU's kernel keeps the input's (pure bf16 ViT-B at batch 64: 1.2 MB).
    And on CUDA, the memory-efficient attention kernel's RNG seed and offset, which it keeps on the
    host outside CUDA-graph capture (two 512-byte blocks a layer). And a grouped matrix product
    (``_grouped_mm``, transformers' experts) in a dtype its meta kernel refuses: that kernel holds
    every input to the checks of CUDA's fast path (bfloat16 alone, or float16 where cuBLASLt
    serves it), while CPU's kernel and CUDA's fallback (a product per group, written into one
    output) take any float; the output is the one both make, through the helper the meta kernel
    shares with them."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            return _grouped_mm_output(*args, **kwargs)
        if func in PINNING:
            return _pinning(func, args[0])
        out = func(*args, **kwargs)
        if self.cuda and _on_host_alone(args):  # run where its inputs are: on the host
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not is_on_host(t):
                    on_host(t)
        if func is aten._scaled_dot_product_efficient_attention.default and self.cuda:
            return out[0], out[1], on_host(out[2]), on_host(out[3])
        if func is aten.native_batch_norm.default and self.cuda:
            dtype = torch.promote_types(args[0].dtype, torch.float32)
        elif func is aten.native_batch_norm.default and args[1] is not None:
            dtype = args[1].dtype
        elif (
            func is aten.native_layer_norm.default
            and self.cuda
            and args[0].dtype in (torch.float16, torch.bfloat16)
        ):
            dtype = torch.float32
        else:
            return out
        return out[0], out[1].to(dtype), out[2].to(dtype)


def _pinning(func: Any, t: torch.Tensor) -> Any:
    """``Tensor.pin_memory()``'s new pinned copy of ``t``, or whether ``t`` stands for pinned
    memory (``is_pinned()``)."""
    if func is aten.is_pinned.default:
        return marked_pinned(t)
    return on_host(torch.empty_like(t), pinned=True)


def _on_host_alone(args: tuple) -> bool:
    """Whether an operator's tensor arguments (a list's first, for a foreach operator's) all stand
    for host tensors: on CUDA such an operator runs on the host and makes host tensors (an optimizer
    stepping offloaded partitions, making their moments)."""
    seen = False
    for a in args:  # on every operator a CUDA prediction runs: out at the first device tensor
        t = a[0] if isinstance(a, list | tuple) and a else a
        if isinstance(t, torch.Tensor):
            if not is_on_host(t):
                return False
            seen = True
    return seen


def _grouped_mm_output(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``_grouped_mm``'s output as ATen's ``create_grouped_gemm_output_tensor`` makes it for every
    kernel (its rows padded to 16 bytes)."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    if bias is not None:
        raise NotImplementedError("_grouped_mm with a bias: no kernel takes one yet")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype or mat_a.dtype)


@contextmanager
def parameters_as_real() -> Iterator[None]:
    """Fake parameters copied and converted as real ones are. ``Module.to()`` sets a real
    parameter's converted copy in place (``.data =``) but swaps a fake one for it, which fake
    tensors' weak references refuse; and a deep-copied fake tensor's views get storages of their
    own, so the tracker would count a view of it as new bytes. channels-last converts the model;
    peft casts its adapters and copies the head."""
    swap = torch.utils.swap_tensors

    def set_in_place(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
            return swap(t1, t2)
        t1.data = t2.detach()

    def deepcopy(t: FakeTensor, memo: dict[int, Any]) -> torch.Tensor:
        if id(t) not in memo:
            twin = t.detach().clone()
            if isinstance(t, nn.Parameter):
                memo[id(t)] = nn.Parameter(twin, t.requires_grad)
            else:
                memo[id(t)] = twin
        return memo[id(t)]

    with (
        patch.object(torch.utils, "swap_tensors", set_in_place),
        patch.object(FakeTensor, "__deepcopy__", deepcopy, create=True),
    ):
        yield


@contextmanager
def masks_as_real() -> Iterator[None]:
    """transformers takes fake tensors for tracing, and then always builds the attention mask; a
    real run without padding (every synthetic batch) skips it, so SDPA may pick flash. Here fake
    inputs are not taken for tracing: the mask's check reads True (ScalarsRead) and the
    prediction takes the real run's path."""
    # imported by then if the model needs it
    utils = sys.modules.get("transformers.utils.import_utils")
    # a transformers without the check builds masks as it would
    known = hasattr(utils, "is_fake_tensor")
    with patch.object(utils, "is_fake_tensor", lambda _: False) if known else nullcontext():
        yield


def compiled_as_eager(step: Callable[..., Any]) -> Callable[..., Any]:
    """The optimizer's ``step`` with ``torch.compile`` handing back the function itself: fake
    tensors cannot enter compiled code (dynamo refuses to trace under the fake mode). The tracker
    steps aside for that step as on a real run (``Technique.compiled_update``), so the state is
    counted and the eager update's temporaries, which the compiled kernel would not keep, are not.
    Patched for the step alone, so that nothing compiled elsewhere in the process (an import's
    decorator) stays eager."""

    def eager(model: Callable[..., Any] | None = None, **_: Any) -> Any:
        if model is not None:
            return model
        return lambda fn: fn

    def run(*args: Any, **kwargs: Any) -> Any:
        with patch.object(torch, "compile", eager):
            return step(*args, **kwargs)

    return run


@contextmanager
def generation_as_real(
    new_tokens: int, marking: Callable[[], None] | None = None
) -> Iterator[None]:
    """generate() stops when every sequence is finished, which it reads off a tensor: on fake
    tensors that reads True (ScalarsRead) and generation would stop after its first token. A
    run generates exactly ``new_tokens`` (min_new_tokens equals it), one per pass of generate()'s
    loop, so its check says so: true ``new_tokens`` times, then false, afresh for each call of
    generate(); ``marking`` is called at each check, where one pass ends and the next begins (a
    prediction's fold of the decode forwards stops the loop early, the cache sized for every new
    token). Its sanity checks read True too, and would warn of right-padding and negative token
    ids the real run has none of: its warnings are held back."""
    from transformers.generation.utils import GenerationMixin
    from transformers.utils import logging

    generate, left = GenerationMixin.generate, [0]

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        left[0] = new_tokens
        return generate(self, *args, **kwargs)

    def unfinished(self: Any, *args: Any, **kwargs: Any) -> bool:
        if marking is not None:
            marking()
        left[0] -= 1
        return left[0] >= 0

    logger = logging.get_logger("transformers.generation.utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with (
            patch.object(GenerationMixin, "generate", counted),
            patch.object(GenerationMixin, "_has_unfinished_sequences", unfinished),
        ):
            yield
    finally:
        logger.setLevel(level)
