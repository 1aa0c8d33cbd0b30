"""The fidelity phase: does the technique change what the model learns?

Inside the run's process, after the measured steps: train the run's model (or the suite's stand-in)
with its techniques on real data from the same initial weights and the same data order as the
baseline (both follow the seed), then evaluate on the held-out split. The baseline is trained with
several seeds; the spread of their accuracies is the noise band a delta is held against.

A language model (objective "next-token") trains on each sequence followed by its class as one more
token (padding is no target), and is scored on predicting that token.

Inference suites train the plain model instead, then evaluate it under the run's techniques, and
also report how often its predictions agree with the fp32 model's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench import models, progress
from bench.data import real
from bench.data.synthetic import Batch
from bench.infer import forward
from bench.models import ModelSpec
from bench.recipe import Recipe, Stepper
from bench.record import FidelityResult
from bench.suite import Fidelity, RunSpec, Shapes

EVAL_BATCH = 256
# final_loss: mean training loss over the last steps, less noisy than the very last one
LAST_STEPS = 10


@dataclass(frozen=True, kw_only=True)
class HeldOut:
    """A model evaluated on the held-out split: its accuracy, mean loss and each sample's class."""

    accuracy: float
    loss: float
    predictions: torch.Tensor


def run_fidelity(spec: RunSpec, fid: Fidelity, device: torch.device) -> FidelityResult:
    stand_in = fid.model or spec.model_on(device.type)
    model_spec = models.resolve(stand_in)
    train, test = real.load(fid.dataset, model_spec.inputs, fid.image_size)
    classes = train.num_classes
    if len(train) < fid.batch_size:  # no full batch to draw: training would wait for one forever
        raise real.DataError(
            f"dataset {fid.dataset!r}: {len(train)} training samples, fewer than [fidelity] "
            f"batch_size = {fid.batch_size}; lower batch_size or use a larger dataset"
        )
    if model_spec.objective in ("masked-lm", "seq2seq"):
        kind = {"masked-lm": "a masked language model", "seq2seq": "an encoder-decoder"}
        raise real.DataError(
            f"model {model_spec.name} is {kind[model_spec.objective]}: the fidelity phase has no "
            "task for one yet (its class would be a token it writes); set [fidelity] enabled = "
            "false"
        )
    if model_spec.objective == "next-token":
        train, test = real.with_label_token(train), real.with_label_token(test)
        if real.LABEL_TOKEN + classes > model_spec.num_classes:
            raise real.DataError(
                f"dataset {fid.dataset!r}: language model {model_spec.name} has "
                f"{model_spec.num_classes} tokens; its {classes} classes are tokens "
                f"{real.LABEL_TOKEN}…{real.LABEL_TOKEN + classes - 1}"
            )
    elif classes > model_spec.num_classes:
        raise real.DataError(
            f"dataset {fid.dataset!r} has {classes} classes; model {model_spec.name} predicts "
            f"{model_spec.num_classes}"
        )
    shapes = Shapes(
        batch_size=fid.batch_size,
        image_size=fid.image_size if model_spec.inputs == "image" else None,
        seq_len=int(train.inputs.shape[1]) if model_spec.inputs == "tokens" else None,
    )
    if spec.name == spec.baseline:
        seeds = range(spec.seed, spec.seed + fid.seeds)
    else:
        seeds = [spec.seed]
    if spec.mode == "inference":
        one = _inference_seed
    else:
        one = _train_seed
    recipes = [
        Recipe.of(spec, device, shapes, model=stand_in, lr=fid.lr, seed=seed) for seed in seeds
    ]
    results = [one(recipe, fid, train, test, classes) for recipe in recipes]
    out = results[0] | FidelityResult(
        fidelity_model=model_spec.name,
        fidelity_weights=fid.weights,
        fidelity_dataset=fid.dataset,
        fidelity_steps=fid.steps,
        fidelity_train_size=len(train),
        fidelity_test_size=len(test),
    )
    if len(results) > 1:
        out.accuracy_seeds = [r.accuracy for r in results]
    return out


def _train_seed(
    recipe: Recipe, fid: Fidelity, train: real.Labelled, test: real.Labelled, classes: int
) -> FidelityResult:
    model_spec, device = recipe.ctx.model_spec, recipe.ctx.device
    model = recipe.model(fid.weights)[0]
    batches = _batches(train, fid, seed=recipe.seed, device=device, model_spec=model_spec)
    first = next(batches)  # padded, for the plain model's reference gradient
    plain = copy.deepcopy(model)
    captured: dict[str, torch.Tensor] = {}

    # Registered before the techniques apply, on the plain model's names, so these hooks run before
    # any that free gradients early (optimizer-in-backward); with accumulation the last call holds
    # the whole batch's gradient. Copies: zero_grad(set_to_none=False) would zero a kept reference.
    def keep(name: str) -> Any:
        return lambda p: captured.__setitem__(name, p.grad.detach().float().clone())

    hooks = [p.register_post_accumulate_grad_hook(keep(n)) for n, p in model.named_parameters()]
    trainer = recipe.stepper(model)
    # The plain model's gradient on the same weights and batch, with the random state the run's
    # first step will see (the same dropout masks), restored afterwards.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        reference = _gradients(plain, model_spec, first)
    losses = [trainer.step(recipe.regroup(first))]
    for h in hooks:
        h.remove()
    for step in range(2, fid.steps + 1):
        progress.say(f"fidelity phase, seed {recipe.seed}", step, fid.steps)
        losses.append(trainer.step(recipe.regroup(next(batches))))
    final = torch.stack(losses[-LAST_STEPS:]).float().mean().item()
    held_out = _evaluate(trainer, test, device=device, classes=classes, regroup=recipe.regroup)
    return FidelityResult(
        accuracy=held_out.accuracy,
        fidelity_test_loss=held_out.loss,
        final_loss=final,
        grad_cosine=_cosine(reference, captured),
    )


def _inference_seed(
    recipe: Recipe, fid: Fidelity, train: real.Labelled, test: real.Labelled, classes: int
) -> FidelityResult:
    device = recipe.ctx.device
    plain = recipe.stepper(recipe.model(fid.weights)[0], [], inference=False)
    batches = _batches(
        train, fid, seed=recipe.seed, device=device, model_spec=recipe.ctx.model_spec
    )
    losses = []
    for step in range(1, fid.steps + 1):
        progress.say(f"fidelity phase, seed {recipe.seed}", step, fid.steps)
        losses.append(plain.step(next(batches)))
    reference = _evaluate(recipe.stepper(plain.model, []), test, device, classes)
    served = recipe.stepper(plain.model)
    held_out = _evaluate(served, test, device=device, classes=classes, regroup=recipe.regroup)
    agree = (held_out.predictions == reference.predictions).float().mean().item()
    final = torch.stack(losses[-LAST_STEPS:]).float().mean().item()
    return FidelityResult(
        accuracy=held_out.accuracy,
        fidelity_test_loss=held_out.loss,
        final_loss=final,
        fidelity_agreement=agree,
    )


def _batches(
    data: real.Labelled, fid: Fidelity, seed: int, device: torch.device, model_spec: ModelSpec
) -> Iterator[Batch]:
    """Shuffled batches from a seeded generator, epoch after epoch: the same order for every
    technique. A language model's targets are its input ids (the class is the last of them), padding
    left out."""
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(data), generator=g)
        for i in range(0, len(order) - fid.batch_size + 1, fid.batch_size):
            inputs, labels = data.batch(order[i : i + fid.batch_size], device)
            if model_spec.objective == "next-token":
                labels = inputs["input_ids"].masked_fill(
                    inputs["input_ids"] == real.PAD, models.IGNORE
                )
            yield inputs, labels


def _gradients(model: nn.Module, model_spec: ModelSpec, batch: Batch) -> dict[str, torch.Tensor]:
    model.train()
    model_spec.loss(model_spec.logits(model, batch[0]), batch[1]).backward()
    return {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}


def _cosine(reference: dict[str, torch.Tensor], captured: dict[str, torch.Tensor]) -> float | None:
    """Cosine similarity of the two first-step gradients over the parameters both have (a technique
    that freezes or replaces parameters, like LoRA or sharing, is compared on what is left)."""
    common = [n for n in reference if n in captured and captured[n].shape == reference[n].shape]
    if not common:
        return None
    a = torch.cat(
        [reference[n].flatten() for n in common]
    ).double()  # float32 sums drift past 1 at this size
    b = torch.cat([captured[n].flatten().to(a.device) for n in common]).double()
    return nn.functional.cosine_similarity(a, b, dim=0).item()


def _class_scores(
    model_spec: ModelSpec, logits: torch.Tensor, inputs: Any, classes: int
) -> torch.Tensor:
    """A language model's scores for the classes are its logits for the class tokens at the position
    before the class token, each sequence's last (causal: it has seen the sequence, not the class);
    in a packed row, two before each sequence's end."""
    if model_spec.objective == "classify":
        return logits
    if "cu_seq_lens_q" in inputs:
        rows = torch.zeros_like(inputs["cu_seq_lens_q"][1:])
        before = inputs["cu_seq_lens_q"][1:] - 2
    else:
        rows, before = torch.arange(len(logits)), real.lengths(inputs["input_ids"]) - 2
    return logits[rows.long(), before.long(), real.LABEL_TOKEN : real.LABEL_TOKEN + classes]


def _evaluate(
    runner: Stepper,
    test: real.Labelled,
    device: torch.device,
    classes: int,
    regroup: Callable[[Batch], Batch] | None = None,
) -> HeldOut:
    """Held-out accuracy and loss over the classes, through the techniques' own batches
    (``regroup``), batch preparation and step contexts. Every batch has the same size (the last is
    padded with repeats, dropped afterwards): traced and compiled models keep the shape they were
    built for."""
    model, techniques, n = runner.model, runner.techniques, len(test)
    was_training = model.training
    model.eval()
    predictions, loss = [], 0.0
    with torch.no_grad():
        for i in range(0, n, EVAL_BATCH):
            batch = test.batch(torch.arange(i, i + EVAL_BATCH) % n, device)
            if regroup:
                # the technique's batches; the labels stay the classes (a language model's too)
                batch = regroup(batch)[0], batch[1]
            logits, labels = forward(runner.spec, model, techniques, batch)
            logits = _class_scores(runner.spec, logits, batch[0], classes).float()[: n - i]
            loss += nn.functional.cross_entropy(logits, labels[: n - i], reduction="sum").item()
            predictions.append(logits.argmax(dim=1).cpu())
    model.train(was_training)
    predicted = torch.cat(predictions)
    accuracy = (predicted == test.labels).float().mean().item()
    return HeldOut(accuracy=accuracy, loss=loss / len(test), predictions=predicted)
