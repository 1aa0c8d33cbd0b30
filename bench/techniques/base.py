"""The technique interface and its registry.

A technique is one small class: a typed ``Config`` dataclass (each field documented with ``option``) and
the hooks for the phases of a run it touches. Most override one hook. Hooks run in the order the suite
lists the techniques. Every technique reports ``proof()``: evidence, read off the live run, that it was
really applied.
"""

from __future__ import annotations

import typing
from contextlib import AbstractContextManager, nullcontext
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from bench.registry import Registry, import_object

if TYPE_CHECKING:
    import torch
    from torch import nn

    from bench.data.synthetic import Batch
    from bench.models import ModelSpec
    from bench.spec import Shapes, TechniqueSpec

TECHNIQUES: Registry[type[Technique]] = Registry("technique")
TRAIN, INFERENCE = frozenset({"train"}), frozenset({"inference"})
ANY_MODE = TRAIN | INFERENCE  # the suite modes: training steps, or forward passes only


class Unsupported(Exception):
    """Raised by a technique, at any point of a run, when it cannot apply here; the run's status
    becomes ``unsupported`` with this message instead of ``error``."""


def option(default: Any, doc: str) -> Any:
    """A config field with its one-line documentation (shown by ``bench list``)."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class NoOptions:
    """For techniques without options."""


@dataclass
class RunContext:
    """What a technique may look at while it is applied inside the run's process."""

    device: torch.device
    model_spec: ModelSpec
    shapes: Shapes
    lr: float = 1e-4  # the run's learning rate (the suite's lr, or [fidelity] lr in the fidelity phase)
    # True in ``bench predict``: fake tensors on the CPU standing for a CUDA run. Techniques answer
    # ``unsupported`` as they would on CUDA and skip what needs real values (a GradScaler's checks).
    predicting: bool = False
    # Processes in the run (torchrun's WORLD_SIZE) and this one's rank; the process group is up when > 1.
    world_size: int = 1
    rank: int = 0

    @property
    def cuda(self) -> bool:
        """Whether the run is (or stands for) a CUDA run."""
        return self.device.type == "cuda" or self.predicting


class Technique:
    """Base class: every hook defaults to 'leave this phase alone'."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    Config: ClassVar[type] = NoOptions
    # Names of techniques this one cannot be combined with; checked both ways at suite load.
    conflicts: ClassVar[frozenset[str]] = frozenset()
    # False where the live-tensor tracker cannot see what the technique runs (compiled graphs).
    trackable: ClassVar[bool] = True
    # True where the optimizer's step runs compiled code (torchao's update): the tracker steps aside for that
    # step only, so its state is counted and its temporaries are not; fake tensors run the update eager.
    compiled_update: ClassVar[bool] = False
    # Suite modes this technique means something in (checked at suite load).
    modes: ClassVar[frozenset[str]] = TRAIN
    # Why fake tensors on a CPU cannot predict this technique's CUDA memory, if they cannot.
    unpredictable: ClassVar[str] = ""
    # Runs over several processes (the suite entry's nproc, default 2); data_parallel: each rank takes
    # its own batch, so a step processes nproc batches (tensor parallelism shares one).
    distributed: ClassVar[bool] = False
    data_parallel: ClassVar[bool] = False

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else self.Config()

    # -- at suite load, no torch work --
    def problems(self, batch_size: int) -> list[str]:
        """Reasons this configuration cannot run at ``batch_size`` (reported as validation errors)."""
        return []

    def conflict(self, other: Technique) -> str | None:
        """Why this cannot run with ``other`` when that depends on options (names go in ``conflicts``)."""
        return None

    # -- in the parent, before the run's process starts (and so before CUDA initialises) --
    def env(self) -> dict[str, str]:
        return {}

    # -- inside the run's process --
    def unsupported(self, ctx: RunContext) -> str | None:
        """A one-line reason this technique cannot apply here (missing package, device), else None."""
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        return model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        return None

    def prepare_batch(self, batch: Batch) -> Batch:
        """Transform each batch as it enters the step (memory format, dtype)."""
        return batch

    def step_context(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def micro_batches(self) -> int:
        return 1

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take the optimizer step; return True if this technique did it (e.g. through a GradScaler)."""
        return False

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> bool:
        """Clear gradients after the step; return True if this technique did it."""
        return False

    def after_step(self) -> None:
        """Housekeeping once the step is complete (e.g. emptying the allocator cache)."""

    def proof(self, steps: int) -> dict[str, Any]:
        """Evidence this technique was applied, after ``steps`` optimizer steps; flat JSON values."""
        return {}


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
        default = f.default if f.default is not MISSING else None
        hint = hints[f.name]
        kind = (" | ".join(map(repr, typing.get_args(hint))) if typing.get_origin(hint) is Literal
                else getattr(hint, "__name__", str(hint)))
        rows.append((f.name, kind, default, f.metadata.get("doc", "")))
    return rows
