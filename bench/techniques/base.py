"""The technique interface and its registry.

A technique is one small class: a typed ``Config`` dataclass (each field documented with
``option``), the checks that say where it cannot run, and what it changes, each in one method:

- the environment of the run's process (``env``),
- the model (``apply``, a transform),
- the optimizer (``make_optimizer``),
- how batches form from variable-length data (``batching``: the collator and sampler),
- the training step (``step``: a ``Step`` policy of micro-batches, batch preparation, a context
  around forward and loss, loss scaling, the optimizer step, zero-grad, and what follows the step).

Techniques apply in the order the suite lists them. Every technique reports ``proof()``: evidence,
read off the live run, that it was really applied. How a technique runs on fake tensors (bench
predict) is bench.predict's business, not the technique's.

What the rest of the house needs to know of a technique, it declares here too: its place in advice's
catalogue (``axis``, ``offers``, or ``not_advised`` with the reason), the batch multiple it needs
(``batch_multiple``), the bytes it moves between device and host (``host_traffic``) and the
attention kernel it pins (``attention_backend``). Nothing else reads a technique's name or raw
options to find these out.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from bench.registry import Registry, import_object

if TYPE_CHECKING:
    import torch
    from torch import nn

    from bench.data.synthetic import Batch
    from bench.data.varlen import Batching
    from bench.models import ModelSpec
    from bench.spec import Shapes, TechniqueSpec

TECHNIQUES: Registry[type[Technique]] = Registry("technique", names=True)
TRAIN, INFERENCE, GENERATE = frozenset({"train"}), frozenset({"inference"}), frozenset({"generate"})
SERVING = INFERENCE | GENERATE  # no gradients: forward passes, or generation
ANY_MODE = TRAIN | SERVING  # the suite modes: training steps, forward passes only, or generation


class Unsupported(Exception):
    """Raised by a technique, at any point of a run, when it cannot apply here; the run's status
    becomes ``unsupported`` with this message instead of ``error``."""


def listed(option: str | None) -> list[str]:
    """A comma-separated option's names ("q_proj, v_proj"), blanks dropped."""
    return [n.strip() for n in (option or "").split(",") if n.strip()]


def option(default: Any, doc: str) -> Any:
    """A config field with its one-line documentation (shown by ``bench list``)."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True, kw_only=True)
class Step:
    """What a technique changes in the training step (and, for batch and context, in an inference
    step or a generation; ``generation`` in the latter alone). The trainer composes every
    technique's, in the suite's order; a field left at its default changes nothing."""

    micro_batches: int = 1  # the batch is split in this many, their gradients accumulated
    # each batch as it enters the step (memory format, dtype)
    prepare: Callable[[Batch], Batch] | None = None
    # around each forward and its loss
    context: Callable[[], AbstractContextManager[Any]] | None = None
    # Instead of the model spec's loss, on what the model returned and the labels (a loss that never
    # makes the full logits: the model returns its last hidden states then).
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None  # before backward
    # instead of loss.backward(): the loss, and whether its micro-batch is the step's last (an
    # engine that reduces the gradients at that boundary, DeepSpeed's, runs its own backward)
    backward: Callable[[torch.Tensor, bool], None] | None = None
    # the gradients unscaled in place, where the loss was scaled: before clipping, as accelerate
    # unscales them
    unscale: Callable[[torch.optim.Optimizer], None] | None = None
    # after the last backward, before the optimizer step (clipping the gradients' norm)
    clip: Callable[[torch.optim.Optimizer], None] | None = None
    # instead of optimizer.step()
    optimizer_step: Callable[[torch.optim.Optimizer], None] | None = None
    # instead of zero_grad(set_to_none=True)
    zero_grad: Callable[[torch.optim.Optimizer], None] | None = None
    # once the step is complete (e.g. emptying the allocator's cache)
    after: Callable[[], None] | None = None
    # Generation: keyword arguments of transformers' generate() (the cache it keeps, chunked
    # prefill).
    generation: tuple[tuple[str, Any], ...] = ()


def combined(steps: list[Step]) -> Step:
    """The techniques' steps as one, in the suite's order: micro-batches multiply; batch
    preparation, contexts (the first outermost), loss scaling and what follows the step chain; the
    first technique that takes the loss, the unscaling, the clipping, the optimizer step or the
    zero-grad takes it."""

    def chain(fns: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
        def run(x: Any) -> Any:
            for fn in fns:
                x = fn(x)
            return x

        return run

    @contextmanager
    def contexts() -> Iterator[None]:
        with ExitStack() as stack:
            for s in steps:
                if s.context is not None:
                    stack.enter_context(s.context())
            yield

    def first(name: str) -> Any:
        return next((getattr(s, name) for s in steps if getattr(s, name) is not None), None)

    def after() -> None:
        for s in steps:
            if s.after is not None:
                s.after()

    return Step(
        micro_batches=math.prod(s.micro_batches for s in steps),
        prepare=chain([s.prepare for s in steps if s.prepare is not None]),
        context=contexts,
        loss=first("loss"),
        scale_loss=chain([s.scale_loss for s in steps if s.scale_loss is not None]),
        backward=first("backward"),
        unscale=first("unscale"),
        clip=first("clip"),
        optimizer_step=first("optimizer_step"),
        zero_grad=first("zero_grad"),
        after=after,
        generation=tuple(kv for s in steps for kv in s.generation),
    )


@dataclass(frozen=True)
class Offer:
    """One setting advice tries a technique at: ``label`` is its part of a plan's name
    ("checkpoint-every-2"), ``options`` the suite options it sets, and ``computes`` the dtype its
    kernels compute in where it changes it (a speed that counting FLOPs cannot see)."""

    label: str
    options: tuple[tuple[str, Any], ...] = ()
    computes: str | None = None


def offer(label: str, computes: str | None = None, **options: Any) -> Offer:
    return Offer(label, tuple(sorted(options.items())), computes)


# Advice's axes, in the order a plan names them: the kinds of memory a technique saves, one
# technique each.
AXES = (
    "precision",
    "activations",
    "optimizer",
    "accumulation",
    "loss",
    "sharding",
    "quantization",
    "autograd",
    "cache",
)


@dataclass(frozen=True)
class NoOptions:
    """For techniques without options."""


@dataclass(kw_only=True)
class RunContext:
    """What a technique may look at while it is applied inside the run's process."""

    device: torch.device
    model_spec: ModelSpec
    shapes: Shapes
    # the run's learning rate (the suite's lr, or [fidelity] lr in the fidelity phase)
    lr: float = 1e-4
    # True in ``bench predict``: fake tensors on the CPU standing for a CUDA run. Techniques read it
    # through ``cuda`` and answer ``unsupported`` as they would on CUDA; bench.predict.stand_ins
    # does the rest.
    predicting: bool = False
    # Processes in the run (torchrun's WORLD_SIZE) and this one's rank; the process group is up when
    # > 1.
    world_size: int = 1
    rank: int = 0

    @property
    def cuda(self) -> bool:
        """Whether the run is (or stands for) a CUDA run."""
        return self.device.type == "cuda" or self.predicting


class Technique:
    """Base class: every hook defaults to 'leave this phase alone'. Its members are grouped by who
    reads them (``INTERFACE``, and the table of docs/techniques.md made from it): a new technique
    sets what it is and the hooks that change the run, and the groups between where the loader,
    advice or prediction needs telling."""

    name: ClassVar[str] = ""  # set by TECHNIQUES.register; a user's own class may set it
    summary: ClassVar[str] = ""  # what it does, in a line (bench list, the docs' table)
    Config: ClassVar[type] = NoOptions  # its options: a frozen dataclass, each field an ``option``

    # -- what it applies to: read by the suite loader (and by advice, to skip what cannot apply) --

    # Suite modes this technique means something in.
    modes: ClassVar[frozenset[str]] = TRAIN
    # The model inputs this technique applies to ("tokens", "image"); None: any.
    inputs: ClassVar[str | None] = None
    # The model objective it applies to ("next-token"); None: any.
    objective: ClassVar[str | None] = None
    # Runs over several processes (the suite entry's nproc, default 2); data_parallel: each rank
    # takes its own batch, so a step processes nproc batches (tensor parallelism shares one).
    distributed: ClassVar[bool] = False
    data_parallel: ClassVar[bool] = False
    # Names of techniques this one cannot be combined with; checked both ways.
    conflicts: ClassVar[frozenset[str]] = frozenset()
    # Adds trainable adapters to a frozen base (lora, qlora): a cast after it would cast them too
    # (``follows``).
    adapts: ClassVar[bool] = False

    def batch_multiple(self) -> int:
        """What the batch must be a multiple of for this configuration to run (its
        micro-batches)."""
        return 1

    def problems(self, batch_size: int) -> list[str]:
        """Reasons this configuration cannot run at ``batch_size`` (reported as validation
        errors)."""
        return []

    def conflict(self, other: Technique) -> str | None:
        """Why this cannot run with ``other`` when that depends on options (names go in
        ``conflicts``)."""
        return None

    def follows(self, earlier: Technique) -> str | None:
        """Why this cannot come after ``earlier`` in a run, where the order would change what it
        does (a cast after adapters casts them too): the loader refuses the ambiguous order rather
        than pick one silently."""
        return None

    # -- its place in advice: read by advice's catalogue and time estimate (bench/advise) --

    # The axis of AXES it saves memory on (a plan takes one technique an axis) and the settings
    # advice tries, in order; or, for a technique advice leaves out, why (tests hold every one to
    # one or the other).
    axis: ClassVar[str] = ""
    offers: ClassVar[tuple[Offer, ...]] = ()
    not_advised: ClassVar[str] = ""
    # Bytes it moves between device and host each step, for advice's time estimate: "activations"
    # (those it keeps off the device, down in forward and up in backward), "optimizer" (gradients
    # down, weights up), or none; ``overlaps_traffic``: the copies run on a side stream, under
    # compute.
    host_traffic: ClassVar[Literal["", "activations", "optimizer"]] = ""
    overlaps_traffic: ClassVar[bool] = False

    @classmethod
    def offered(cls, model: ModelSpec, mode: str, nproc: int, batch: int) -> tuple[Offer, ...]:
        """The settings advice tries for a model in a mode, over ``nproc`` processes at ``batch``
        per process: those whose mode, inputs, objective and process count fit, and whose batch
        multiple divides the batch."""
        fits = (
            mode in cls.modes
            and cls.inputs in (None, model.inputs)
            and cls.objective in (None, model.objective)
            and (nproc > 1 or not cls.distributed)
        )
        return tuple(
            o
            for o in cls.offers
            if fits and batch % cls(cls.Config(**dict(o.options))).batch_multiple() == 0
        )

    # -- what prediction needs: read by the tracker and by bench/predict --

    # False where the live-tensor tracker cannot see what the technique runs (compiled graphs).
    trackable: ClassVar[bool] = True
    # True where the optimizer's step runs compiled code (torchao's update): the tracker steps aside
    # for that step only, so its state is counted and its temporaries are not; fake tensors run the
    # update eager.
    compiled_update: ClassVar[bool] = False
    # Why fake tensors on a CPU cannot predict this technique's CUDA memory, if they cannot.
    unpredictable: ClassVar[str] = ""
    # What a prediction's figures stand for where fake tensors run a stand-in for it (compile: the
    # eager step): said beside the figures, which are given, never left out.
    approximate: ClassVar[str] = ""
    # Library calls fake tensors cannot run (they need values, streams or host memory), each
    # replaced while the run is predicted by one that makes the same tensors: {"module:attribute":
    # "module:replacement"}. The built-in ones live in bench.predict.stand_ins.
    stand_ins: ClassVar[dict[str, str]] = {}
    # Library calls whose CUDA kernels keep other tensors than the CPU's and fake ones show,
    # replaced the same way where a prediction models CUDA (bench.predict.cuda)
    cuda_stand_ins: ClassVar[dict[str, str]] = {}

    def attention_backend(self) -> str | None:
        """The SDPA backend this configuration pins, which a prediction for CUDA must model; None:
        CUDA picks."""
        return None

    def layers_alike(self) -> bool:
        """Whether it does to every repeated layer what it does to any: then a deep model's step is
        predicted from a few of its layers (bench.predict.depth). False for one that treats layers
        by their place (every k-th, shared across several)."""
        return True

    # -- the hooks that change the run: read by the worker, in this order --

    def __init__(self, config: Any = None) -> None:
        if config is not None:
            self.config = config
        else:
            self.config = self.Config()

    def env(self) -> dict[str, str]:
        """The run's process environment it sets, in the parent, before the process (and CUDA)
        starts."""
        return {}

    def unsupported(self, ctx: RunContext) -> str | None:
        """A one-line reason this technique cannot apply here (missing package, device), else
        None."""
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        """The model, transformed (wrapped, cast, adapted), inside the run's process."""
        return model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        """The optimizer for the model as applied, or None to leave it to another technique or
        AdamW."""
        return None

    def engine(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int
    ) -> tuple[nn.Module, torch.optim.Optimizer] | None:
        """An engine that takes the model and its optimizer over once both are made (DeepSpeed's),
        as (the model it runs, the optimizer it steps), the step's ``micro_batches`` told; None:
        no engine."""
        return None

    @property
    def makes_optimizer(self) -> bool:
        """Whether ``make_optimizer`` makes one (checked at suite load: two that do cannot share a
        run)."""
        return type(self).make_optimizer is not Technique.make_optimizer

    def batching(self, ctx: RunContext) -> Batching | None:
        """How variable-length sequences become batches (collator, sampler), or None to leave it to
        another technique or to padding to seq_len."""
        return None

    def fixed(self, batch: Batch, ctx: RunContext, parts: int) -> Batch | None:
        """A run without lengths: its fixed-shape batch (every sequence seq_len tokens) formed as
        this technique forms batches, in ``parts`` micro-batches; None where it forms batches of
        variable-length data alone (the loader then asks for lengths)."""
        return None

    def replicas(self, world_size: int) -> int:
        """How many of the ``world_size`` ranks take batches of their own (a group shares one under
        tensor parallelism): a step of the run processes that many."""
        if self.data_parallel:
            return world_size
        return 1

    def step(self) -> Step:
        """What this technique changes in each step, once it is applied."""
        return Step()

    # The proof's key that counts what the technique changed in the model (modules wrapped, layers
    # adapted): at 0 it applied to nothing, and a run that measured the baseline under its name
    # would say `ok`.
    changes: ClassVar[str] = ""

    def proof(self, steps: int) -> dict[str, Any]:
        """Evidence this technique was applied, after ``steps`` optimizer steps; flat JSON
        values."""
        return {}


# The members of Technique by who reads them, in the class's order (docs/techniques.md's interface
# table).
INTERFACE = {
    "what it is: the registry, bench list": ("name", "summary", "Config"),
    "what it applies to: the suite loader, advice": (
        "modes", "inputs", "objective", "distributed", "data_parallel", "conflicts", "adapts",
        "batch_multiple", "problems", "conflict", "follows",
    ),
    "its place in advice: its catalogue and time estimate": (
        "axis", "offers", "not_advised", "host_traffic", "overlaps_traffic", "offered",
    ),
    "what prediction needs: the tracker, bench/predict": (
        "trackable", "compiled_update", "unpredictable", "approximate", "stand_ins",
        "cuda_stand_ins", "attention_backend", "layers_alike",
    ),
    "the hooks that change the run: the worker, in this order": (
        "env", "unsupported", "apply", "make_optimizer", "makes_optimizer", "engine", "batching",
        "fixed", "replicas", "step", "changes", "proof",
    ),
}  # fmt: skip


def applied(model: nn.Module, techniques: list[Technique], ctx: RunContext) -> nn.Module:
    """The model with each technique applied, in the suite's order; Unsupported, with the reason,
    where a technique's proof says it changed nothing in this model."""
    for t in techniques:
        model = t.apply(model, ctx)
    for t in techniques:
        if t.changes and not t.proof(0).get(t.changes):
            raise Unsupported(
                f"{t.name}: {t.changes} = 0: it found nothing to apply to in this model, so the "
                "run would measure the baseline under its name"
            )
    return model


def resolve(name: str) -> type[Technique]:
    """A registered name, or ``"package.module:Class"`` for a user's own technique."""
    if ":" not in name:
        return TECHNIQUES.get(name)
    obj = import_object(name, "technique")
    if not (isinstance(obj, type) and issubclass(obj, Technique)):
        raise KeyError(f"{name!r} is not a subclass of bench.techniques.Technique")
    return obj


def build(spec: TechniqueSpec) -> Technique:
    """The technique a suite entry names, configured with its options."""
    cls = resolve(spec.name)
    return cls(cls.Config(**dict(spec.options)))


def options_doc(cls: type[Technique]) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, doc) for each config field, for ``bench list``."""
    rows = []
    hints = typing.get_type_hints(cls.Config)
    for f in fields(cls.Config):
        if f.default is not MISSING:
            default = f.default
        else:
            default = None
        hint = hints[f.name]
        if typing.get_origin(hint) is Literal:
            kind = " | ".join(map(repr, typing.get_args(hint)))
        else:
            kind = getattr(hint, "__name__", str(hint))
        rows.append((f.name, kind, default, f.metadata.get("doc", "")))
    return rows
