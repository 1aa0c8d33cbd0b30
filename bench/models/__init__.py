"""Model registry: each entry builds a randomly initialised model from its config (nothing
downloaded) and says what its inputs look like and which blocks repeat (the units checkpointing
wraps).

A user's own model is a ``ModelSpec`` in their own module, named in a suite as ``"module:NAME"``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn
from torch.nn import functional as F

from bench.record import Provenance
from bench.registry import Registry, import_object
from bench.spec import HF

if TYPE_CHECKING:
    from bench.spec import Shapes

Inputs = torch.Tensor | dict[str, torch.Tensor]
IGNORE = -100  # a language model's target after its last position, where there is no next token


# Where repeated blocks are kept: DenseNet's dense layers sit in a ModuleDict (its _DenseBlock).
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def repeated_blocks(model: nn.Module) -> list[str]:
    """Dotted names of the repeated blocks, in module order: every run of two or more consecutive
    children of one class in a ModuleList, Sequential or ModuleDict (torchvision's ResNet stages and
    ViT encoder, BERT's layers, DenseNet's dense layers, and MobileNetV3's inverted residuals
    between its stem and head), then any other module of a class found so (EfficientNet's stages of
    a single block). A run of plain containers is looked into, not wrapped."""
    found: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, CONTAINERS) and not _inside(name, found):
            found += [f"{name}.{child}" if name else child for child in _runs(module)]
    classes = {type(model.get_submodule(b)) for b in found}
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    single = [
        n
        for n, m in model.named_modules()
        if type(m) in classes and n not in found and not _inside(n, found)
    ]
    return sorted(found + single, key=order.__getitem__)


# Set on a stack of layers cut to a few (bench.predict.depth): its layers are repeated blocks
# however few are left, as they were in the whole model.
CUT_STACK = "bench_cut_stack"


def _runs(container: nn.Module) -> list[str]:
    """Names of the children in runs of two or more consecutive children of one class (not a
    container); every child of a stack cut short."""
    if getattr(container, CUT_STACK, False):
        return [name for name, _ in container.named_children()]
    runs: list[list[tuple[str, nn.Module]]] = []
    for name, child in container.named_children():
        if runs and type(runs[-1][-1][1]) is type(child):
            runs[-1].append((name, child))
        else:
            runs.append([(name, child)])
    return [
        n for run in runs if len(run) >= 2 and not isinstance(run[0][1], CONTAINERS) for n, _ in run
    ]


def _inside(name: str, blocks: list[str]) -> bool:
    return any(name == b or name.startswith(f"{b}.") for b in blocks)


OBJECTIVES = ("classify", "next-token", "masked-lm", "seq2seq")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model as the harness needs it: how to build it at a run's shapes and what it takes and
    predicts."""

    name: str
    build: Callable[[Shapes], nn.Module]  # random weights, built from a config: nothing downloaded
    # "image": float (batch, 3, image_size, image_size); "tokens": input_ids and attention_mask
    # keyword arguments of (batch, seq_len), returning a mapping with "logits" as transformers'
    # models do.
    inputs: Literal["image", "tokens"]
    num_classes: int
    # Dotted module names of the repeated blocks (residual blocks, encoder layers): the units that
    # checkpointing, offloading, layer sharing and FSDP wrap.
    blocks: Callable[[nn.Module], list[str]] = repeated_blocks
    vocab_size: int = 0  # token models: ids are drawn below this
    # The layout this model shares with a built-in one ("resnet": torchvision's ResNet, "vit":
    # torchvision's ViT, "bert": transformers' BERT), for the techniques that name layers (lora,
    # shared-basis).
    family: str = ""
    attention: bool = False  # attention through F.scaled_dot_product_attention (the sdpa technique)
    # "classify": logits (batch, num_classes) against one label per sample. "next-token": a causal
    # language model's logits (batch, seq_len, vocab_size), each position against the next token, as
    # it trains. "masked-lm": a masked language model's logits at every position, scored where the
    # labels are not IGNORE. "seq2seq": an encoder-decoder's logits over its target tokens (the
    # decoder's inputs), each against its target.
    objective: Literal["classify", "next-token", "masked-lm", "seq2seq"] = "classify"
    # False for a model too large to build in a CPU's memory (Llama-3-8B's 32 GB of float32
    # weights): it is predicted, built on the meta device, and runs on CUDA; a CPU run of it is
    # unsupported.
    cpu: bool = True
    off_cpu: str = "too large to build in a CPU's memory"  # why not, where cpu is False
    # The model computes its own loss from the labels passed in, as transformers' Trainer calls it
    # (its causal-LM loss upcasts the logits to float32 and pads the labels), rather than this
    # harness's cross-entropy.
    own_loss: bool = False
    # The modules its build imports (torchvision's or transformers' model code): the fork server
    # imports them once for all of a sweep's runs (bench.launch.process).
    imports: tuple[str, ...] = ()
    # What a prediction of it rests on that its figures do not show (a mixture of experts' routing),
    # given with every prediction of it
    note: str = ""
    # Why its step cannot be predicted on fake tensors (a run on the card still measures it)
    unpredictable: str = ""

    def __post_init__(self) -> None:
        if self.inputs not in ("image", "tokens"):
            raise ValueError(
                f"model {self.name}: inputs must be 'image' or 'tokens', got {self.inputs!r}"
            )
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"model {self.name}: objective must be one of {', '.join(OBJECTIVES)}, got "
                f"{self.objective!r}"
            )
        if self.objective != "classify" and self.inputs != "tokens":
            raise ValueError(
                f"model {self.name}: objective {self.objective!r} needs inputs = 'tokens'"
            )
        if self.num_classes < 1 or (self.inputs == "tokens" and self.vocab_size < 1):
            raise ValueError(
                f"model {self.name}: num_classes (and vocab_size for tokens) must be at least 1"
            )

    @property
    def shape_keys(self) -> tuple[str, ...]:
        """The shape entries a suite must give for this model besides batch_size."""
        if self.inputs == "image":
            return ("image_size",)
        return ("seq_len",)

    def forward(
        self,
        model: nn.Module,
        inputs: Inputs,
        labels: torch.Tensor,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward and its mean loss: ``loss`` where a technique takes it (on what the model
        returned), else the model's own from the labels (``own_loss``; its outputs are dropped on
        return, as the Trainer's compute_loss drops them), else ``self.loss``. Returns the logits
        too, for their dtype."""
        if self.own_loss and loss is None:
            out = model(**inputs, labels=labels)
            return out["logits"], out["loss"]
        logits = self.logits(model, inputs)
        return logits, (loss or self.loss)(logits, labels)

    def logits(self, model: nn.Module, inputs: Inputs) -> torch.Tensor:
        if isinstance(inputs, dict):
            # a ModelOutput, or the plain dict a traced model returns
            return model(**inputs)["logits"]
        return model(inputs)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy. For next-token, ``labels`` are the input ids and position i is scored
        on token i + 1; the labels are shifted rather than the logits, so no copy of the (batch,
        seq, vocab) logits is made (transformers' causal-LM loss does the same)."""
        if logits.shape[-1] < self.num_classes:  # else cross-entropy's 'Target 9 is out of bounds'
            raise ValueError(
                f"model {self.name}: its logits are {logits.shape[-1]} wide but its spec says "
                f"num_classes = {self.num_classes}; make the model's output as wide as num_classes"
            )
        if self.objective == "classify":
            return F.cross_entropy(logits, labels)
        if self.objective == "next-token":
            targets = next_tokens(labels)
        else:
            targets = labels
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """A next-token model's target at each position of (batch, seq_len) ids: the id after it, IGNORE
    after the last."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


MODELS: Registry[ModelSpec] = Registry("model")


def register(spec: ModelSpec) -> ModelSpec:
    return MODELS.register(spec.name)(spec)


def resolve(name: str) -> ModelSpec:
    """A registered name, ``"hf:PATH"`` for a Hugging Face config.json (bench.models.hf), or
    ``"package.module:NAME"`` for a user's own ModelSpec (``"python:NAME"``, one given to
    bench.entry.predict_step)."""
    if name.startswith(HF):
        from bench.models import hf

        return hf.spec(name)
    if ":" not in name:
        return MODELS.get(name)
    spec = import_object(name, "model")
    if not isinstance(spec, ModelSpec):
        raise KeyError(f"model {name!r} is a {type(spec).__name__}, not a bench.models.ModelSpec")
    return spec


def build_model(
    spec: ModelSpec, shapes: Shapes, weights: str | None = None
) -> tuple[nn.Module, Provenance]:
    """The model at these shapes, initialised from the current seed, then its pretrained weights if
    a path is given; with what was loaded (for the record)."""
    from bench.models.weights import load_weights

    model = spec.build(shapes)
    if not weights:
        return model, Provenance()
    return model, load_weights(model, weights)


def children_of(container: str) -> Callable[[nn.Module], list[str]]:
    """Block names for every child of the module(s) named, e.g. ``"layer1,layer2"``; inside a
    wrapper that holds the model (peft's, once LoRA applied), the names it gives them."""

    def names(model: nn.Module) -> list[str]:
        if hasattr(model, "get_base_model"):
            base = model.get_base_model()
        else:
            base = model
        if base is not model:
            at = next(f"{n}." for n, m in model.named_modules() if m is base)
        else:
            at = ""
        out = []
        for path in container.split(","):
            out += [f"{at}{path}.{n}" for n, _ in base.get_submodule(path).named_children()]
        return out

    return names


from bench.models import text, vision  # noqa: F401  (registers the models)
