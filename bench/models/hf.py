"""A model from its Hugging Face ``config.json``: ``model = "hf:PATH"`` in a suite, PATH a folder
holding one (or the file itself), for any architecture transformers builds from a config. Weights
are random, as for every built-in model (``weights`` loads local ones). The head comes from the
config's ``architectures`` (``…ForCausalLM``: a next-token model; ``…ForSequenceClassification`` or
``…ForImageClassification``: a classifier of its ``num_labels``), or from a task named after the
path, ``hf:PATH#sequence-classification``. A token model computes its own loss from the labels, as
the Trainer calls it (the causal-LM loss upcasts the logits to float32). Attention is the config's
``attn_implementation`` where it names one, else SDPA, transformers' own default. The weights are in
the config's ``torch_dtype`` (else float32), as transformers 5's ``from_pretrained`` loads them by
default (``dtype="auto"``): a Llama-3.2 config trains in bfloat16. The name may set either after the
task, as ``from_pretrained`` takes them: ``hf:PATH#causal-lm,dtype=float32``,
``hf:PATH#sequence-classification,attn_implementation=eager``."""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import torch
from torch import nn

from bench.hub import HubError
from bench.models import ModelSpec, flash
from bench.spec import HF, Shapes, hf_config_file

# Each head: the Auto class that builds it, the model's inputs and what it is trained on.
TASKS = {
    "causal-lm": ("AutoModelForCausalLM", "tokens", "next-token"),
    "sequence-classification": ("AutoModelForSequenceClassification", "tokens", "classify"),
    "masked-lm": ("AutoModelForMaskedLM", "tokens", "masked-lm"),
    "seq2seq-lm": ("AutoModelForSeq2SeqLM", "tokens", "seq2seq"),
    "image-classification": ("AutoModelForImageClassification", "image", "classify"),
}
SUFFIXES = {
    "ForCausalLM": "causal-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForMaskedLM": "masked-lm",
    "ForImageClassification": "image-classification",
}
# Model types whose layers are named as Llama's (q/k/v/o, gate/up/down projections): lora's default
# targets.
LLAMA_LAYOUT = {"llama", "mistral", "qwen2", "qwen3"}
# over this many parameters (8 GB of float32), a model is predicted only, as llama3-8b is
CPU_PARAMS = 2e9


DTYPES = ("float32", "bfloat16", "float16")


@functools.cache  # a suite's runs resolve their model many times; its size is counted once
def spec(name: str) -> ModelSpec:
    """The ModelSpec of ``hf:PATH[#task]``; KeyError naming the file and the fix where it cannot be
    read."""
    task, overrides = _fragment(name)
    raw = _read(name) | overrides
    config = _config(name)
    task = task or _task(name, raw, config)
    if task not in TASKS:
        raise KeyError(f"model {name!r}: task {task!r} is none of {', '.join(TASKS)}")
    _, inputs, objective = TASKS[task]
    tokens = inputs == "tokens"
    if objective == "classify":
        classes = config.num_labels
    else:
        classes = config.vocab_size
    named = raw.get("attn_implementation") or raw.get("_attn_implementation")
    attention = named or _default_attention(config, task)
    picked = "as named" if named else "transformers' pick, the config naming none"
    if attention in flash.NAMES:
        _flash_supported(name, config, task)
        picked += "; PyTorch's FlashAttention-2 kernel under transformers' flash path"
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise KeyError(f"model {name!r}: dtype {dtype!r} is none of {', '.join(DTYPES)}")
    experts_note, experts_unpredictable = _experts(config)
    built = lambda shapes: _build(config, task, attention, getattr(torch, dtype), shapes)  # noqa: E731
    return ModelSpec(
        name=name,
        build=built,
        inputs=inputs,
        num_classes=classes,
        vocab_size=config.vocab_size if tokens else 0,
        family="llama" if config.model_type in LLAMA_LAYOUT else "",
        attention=attention == "sdpa",
        objective=objective,
        cpu=_params(config, task) <= CPU_PARAMS and attention not in flash.NAMES,
        off_cpu=_off_cpu(attention),
        own_loss=tokens,
        imports=(_module(config.model_type),),
        note="; ".join(filter(None, (f"attention: {attention} ({picked})", experts_note))),
        unpredictable=experts_unpredictable,
    )


# a config's count of experts, as the MoE families name it (Mixtral; Qwen-MoE, DeepSeek)
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _experts(config: Any) -> tuple[str, str]:
    """A mixture of experts' note and why it is unpredictable ("" for either that does not apply).
    transformers runs the experts of a class that takes ``@use_experts_implementation`` through
    ``grouped_mm`` unless told otherwise (``get_correct_experts_implementation``): every token's
    rows for its top-k experts sorted into one tensor of tokens × k rows, whichever experts the
    router picks, so balanced and worst routing (every token to the same experts) hold the same
    bytes. Other classes loop over the experts the router hits, on tensors sized by its values."""
    experts = next((getattr(config, k) for k in EXPERTS if getattr(config, k, None)), 0)
    if not experts:
        return "", ""
    if "@use_experts_implementation" in _source(config.model_type):
        return (
            f"experts: {experts} a layer, run through transformers' grouped_mm, whose tensors are "
            "the same whatever the router picks: the figures hold for balanced and worst routing "
            "alike",
            "",
        )
    return "", (
        f"its {experts} experts a layer run in transformers' loop over the experts the router "
        "hits, each on the tokens routed to it: tensors sized by the router's values, which fake "
        "tensors do not have (a measured run on the card tells; models whose experts take "
        "@use_experts_implementation, Mixtral's and Qwen-MoE's, are predicted)"
    )


def _source(model_type: str) -> str:
    """The source of a model type's modelling module (where its classes' decorators are read)."""
    import importlib
    import inspect

    return inspect.getsource(importlib.import_module(_module(model_type)))


def _module(model_type: str) -> str:
    """The module of transformers that holds a model type's classes, as its Auto classes find it."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    package = model_type_to_module_name(model_type)  # "deprecated.NAME" for a retired one
    return f"transformers.models.{package}.modeling_{package.rpartition('.')[2]}"


# Config fields a name may set after its task, as from_pretrained takes them.
OVERRIDES = ("attn_implementation", "dtype")


def _fragment(name: str) -> tuple[str, dict[str, str]]:
    """``hf:PATH#task,attn_implementation=eager``: the task named (empty: the config's), and the
    fields set."""
    task, overrides = "", {}
    for item in filter(None, name.removeprefix(HF).partition("#")[2].split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            task = item
        elif key in OVERRIDES:
            overrides[key] = value
        else:
            known = ", ".join(OVERRIDES)
            raise KeyError(f"model {name!r}: {key} cannot be set after the path; one of {known}")
    return task, overrides


def _read(name: str) -> dict[str, Any]:
    try:
        file = hf_config_file(name)
    except HubError as exc:  # neither a file nor a folder here: read as a hub id
        raise KeyError(f"model {name!r}: no such file or folder here; as a hub id, {exc}") from None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KeyError(
            f"model {name!r}: cannot read {file} ({exc.strerror or exc}); give a folder holding "
            "config.json, the file, or a Hugging Face hub id ORG/NAME"
        ) from None
    except json.JSONDecodeError as exc:
        raise KeyError(f"model {name!r}: {file} is not JSON ({exc})") from None


def _task(name: str, raw: dict[str, Any], config: Any) -> str:
    for architecture in raw.get("architectures") or []:
        for suffix, task in SUFFIXES.items():
            if architecture.endswith(suffix):
                return task
        # "…ForConditionalGeneration" names encoder-decoders (T5, BART) and vision-language models
        # alike: an encoder-decoder is one AutoModelForSeq2SeqLM builds
        if architecture.endswith("ForConditionalGeneration") and _seq2seq(config):
            return "seq2seq-lm"
    raise KeyError(
        f"model {name!r}: its config's architectures ({raw.get('architectures')}) name no head "
        f"this harness trains; name one after the path, e.g. {name}#causal-lm ({', '.join(TASKS)})"
    )


def _seq2seq(config: Any) -> bool:
    from transformers import AutoModelForSeq2SeqLM

    return type(config) in AutoModelForSeq2SeqLM._model_mapping


def _off_cpu(attention: str) -> str:
    """Why the model is not run on a CPU, where it is not."""
    if attention in flash.NAMES:
        return "FlashAttention has no CPU kernel"
    return "too large to build in a CPU's memory"


def _flash_supported(name: str, config: Any, task: str) -> None:
    """KeyError where the model's class has no flash path, as transformers refuses it."""
    import transformers

    try:
        model_class = getattr(transformers, TASKS[task][0])._model_mapping[type(config)]
    except KeyError:  # the loader says the task has no such model
        return
    if not getattr(model_class, "_supports_flash_attn", False):
        raise KeyError(
            f"model {name!r}: {model_class.__name__} has no FlashAttention path in transformers; "
            "name attn_implementation = sdpa or eager"
        )


def _default_attention(config: Any, task: str) -> str:
    """The attention transformers picks where none is named: SDPA where the model's class supports
    it, else eager (BLOOM, among others, has no SDPA path)."""
    import transformers

    auto = getattr(transformers, TASKS[task][0])
    try:
        model_class = auto._model_mapping[type(config)]
    except KeyError:  # the loader says the task has no such model
        return "sdpa"
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def _config(name: str) -> Any:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(hf_config_file(name)), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise KeyError(
            f"model {name!r}: transformers cannot build a config from it: {exc}"
        ) from None
    config.use_cache = False  # training keeps no key-value cache
    return config


def _build(config: Any, task: str, attention: str, dtype: torch.dtype, shapes: Shapes) -> nn.Module:
    import transformers

    auto = getattr(transformers, TASKS[task][0])
    if task == "image-classification":
        # the run's images, the patch grid following; the spec's config stays
        config = copy.deepcopy(config)
        config.image_size = shapes.image_size
    if attention in flash.NAMES:  # no flash_attn package: its stand-in (bench.models.flash)
        attention = flash.register()
    model = auto.from_config(config, attn_implementation=attention, dtype=dtype)
    if task == "image-classification":
        return _Logits(model)
    return model


def _params(config: Any, task: str) -> int:
    """Parameters of the model as built, counted on the meta device (nothing allocated)."""
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, TASKS[task][0]).from_config(config)
    return sum(p.numel() for p in model.parameters())


class _Logits(nn.Module):
    """An image classifier taking the batch as its one argument and returning its logits, as the
    harness calls every image model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).logits
