"""A run's training_args: a transformers TrainingArguments file (JSON or YAML) becomes the
techniques and batch it means, what changes no memory is named as ignored, a wrong field is a load
error naming it, and the run holds what the Trainer itself holds in its step."""

import json

import pytest
import torch

from bench.data.synthetic import clone_batch
from bench.measure.memory import tracked_step
from bench.suite import SuiteError, load
from tests.conftest import CPU, build_trainer

ARGS = {
    "output_dir": "out",
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "gradient_checkpointing": True,
    "bf16": True,
    "optim": "adafactor",
    "learning_rate": 2e-5,
    "logging_steps": 5,
}


def suite(tmp_path, args, name="args.json", extra=""):
    (tmp_path / name).write_text(args if isinstance(args, str) else json.dumps(args))
    path = tmp_path / "job.toml"
    path.write_text(
        'model = "hf:suites/configs/tiny-llama"\nbaseline = "baseline"\n[shapes.gpu]\nbatch_size '
        "= 4\n"
        'seq_len = 32\n[shapes.cpu]\nbatch_size = 4\nseq_len = 32\n[[runs]]\nname = "baseline"\n'
        f'techniques = []\n[[runs]]\nname = "trainer"\ntraining_args = "{tmp_path / name}"\n{extra}'
    )
    return path


@pytest.mark.parametrize(
    "name, text",
    [
        ("args.json", json.dumps(ARGS)),
        # as TRL and axolotl write them
        ("args.yaml", "\n".join(f"{k}: {json.dumps(v)}" for k, v in ARGS.items())),
    ],
)
def test_the_fields_that_change_memory_become_techniques_and_the_rest_are_named(
    name, text, tmp_path, capsys
):
    run = load(suite(tmp_path, text, name)).runs[1]
    assert [t.label for t in run.techniques] == [
        "amp(dtype=bfloat16)",
        "optimizer(groups=trainer,kind=adafactor-transformers)",
        "checkpoint",
        "accumulate(micro_batches=2)",
    ]
    assert run.gpu.batch_size == 4  # 2 per device, accumulated twice: the step the harness measures
    assert (
        "ignored, as they change nothing a step holds: learning_rate, logging_steps, output_dir"
        in capsys.readouterr().err
    )


def test_transformers_4s_own_adamw_is_read_as_what_it_was(tmp_path):
    """optim = "adamw_hf", in every TrainingArguments file transformers 4.x wrote: its own AdamW,
    stepping one parameter at a time (as the hf-bert-large suite models it), not a refusal."""
    run = load(suite(tmp_path, ARGS | {"optim": "adamw_hf"})).runs[1]
    assert "optimizer(groups=trainer,impl=single,kind=adamw)" in [t.label for t in run.techniques]


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "change, said",
    [
        (
            {"gradient_acumulation_steps": 2},
            "gradient_acumulation_steps: not a TrainingArguments field",
        ),
        ({"fp16": True}, "bf16 and fp16: both true"),
        ({"optim": "lion_8bit"}, "optim = 'lion_8bit': not modelled here"),
        (
            {"per_device_train_batch_size": 0},
            "per_device_train_batch_size: expected a whole number of at least 1",
        ),
        (
            {"gradient_checkpointing_kwargs": {"preserve_rng_state": False}},
            "only use_reentrant is modelled",
        ),
        # each changes the peak several-fold: refused by name, never read as ignored
        (
            {"deepspeed": "ds_config.json"},
            "deepspeed = 'ds_config.json': changes what a step holds",
        ),
        ({"fsdp": "full_shard auto_wrap"}, "fsdp = 'full_shard auto_wrap': changes what a step"),
        ({"use_liger_kernel": True}, "use_liger_kernel = True: changes what a step holds"),
    ],
)
def test_a_wrong_or_contradictory_field_is_a_load_error_naming_it(change, said, tmp_path):
    with pytest.raises(SuiteError, match=said):
        load(suite(tmp_path, ARGS | change))


def test_the_fields_not_modelled_pass_at_the_defaults_transformers_writes(tmp_path):
    """TrainingArguments.to_json_string writes every field: at its default, a field not modelled
    (no DeepSpeed, no FSDP, fsdp_config's defaults) is no refusal."""
    from transformers import TrainingArguments

    written = json.loads(TrainingArguments(output_dir=str(tmp_path / "out")).to_json_string())
    assert load(suite(tmp_path, written)).runs[1].gpu.batch_size == 8


def test_arguments_and_a_batch_size_of_its_own_are_refused(tmp_path):
    with pytest.raises(SuiteError, match="the arguments give the batch; leave batch_size out"):
        load(suite(tmp_path, ARGS, extra="batch_size = { gpu = 8, cpu = 8 }\n"))


@pytest.mark.parametrize("bf16", [False, True])
def test_the_run_holds_what_the_trainer_holds_for_the_same_arguments(bf16, tmp_path):
    from transformers import Trainer, TrainingArguments

    args = ARGS | {"output_dir": str(tmp_path / "out"), "bf16": bf16, "report_to": []}
    run = load(suite(tmp_path, args)).runs[1]
    ours, batch = build_trainer(run)
    inputs, labels = batch
    model = build_trainer(load(suite(tmp_path, args)).runs[0])[0].model
    theirs = Trainer(model=model, args=TrainingArguments(**args, use_cpu=True, save_strategy="no"))
    theirs.create_optimizer_and_scheduler(num_training_steps=10)
    theirs.current_gradient_accumulation_steps = 2  # what its train loop sets before each step
    model.gradient_checkpointing_enable(args.get("gradient_checkpointing_kwargs"))

    def their_step():  # the Trainer's loop: two micro-batches of 2, then the optimizer's step
        for half in range(2):
            part = {k: v[2 * half : 2 * half + 2].clone() for k, v in inputs.items()}
            theirs.training_step(
                theirs.model, part | {"labels": labels[2 * half : 2 * half + 2].clone()}
            )
        theirs.optimizer.step()
        theirs.optimizer.zero_grad(set_to_none=True)

    ours.step(clone_batch(batch))
    their_step()
    measured = tracked_step(lambda: ours.step(clone_batch(batch)), ours.model, ours.optimizer, CPU)
    reference = tracked_step(their_step, theirs.model, theirs.optimizer, CPU)
    assert type(theirs.optimizer).__name__ == "Adafactor" and torch.is_grad_enabled()
    assert abs(measured.peak_tensor_bytes / reference.peak_tensor_bytes - 1) < 0.01, {
        k: (measured[k], reference[k]) for k in measured if measured[k] != reference[k]
    }


@pytest.mark.parametrize("bits", [8, 32])
def test_the_trainers_paged_adamw_is_the_paged_technique_of_its_bits(bits, tmp_path):
    run = load(suite(tmp_path, ARGS | {"optim": f"paged_adamw_{bits}bit"})).runs[1]
    assert f"paged-adamw-{bits}bit" in [t.name for t in run.techniques]
