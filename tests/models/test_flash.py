"""FlashAttention named by a config or a job (bench.models.flash): transformers' flash path on the
FlashAttention-2 kernel PyTorch carries, predicted on fake tensors, refused where transformers
refuses it, measured on a card."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from bench import models
from bench.launch import Device
from bench.predict import predict
from bench.recipe import Recipe
from bench.suite import Shapes
from tests.helpers import isolated, spec

FLASH = "hf:suites/configs/tiny-llama#causal-lm,attn_implementation=flash_attention_2"
aten = torch.ops.aten


class Calls(TorchDispatchMode):
    """Each flash kernel called, with the heads of its keys (its second argument going forward, its
    third coming back, after the output's gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_flash_attention_forward", "_flash_attention_backward"):
            key = kwargs.get("key", args[1 if name.endswith("forward") else 2])
            self.seen.append((name, key.shape[-2]))
        return func(*args, **kwargs)


def test_a_named_flash_attention_runs_flashattention2_on_its_grouped_keys_as_they_are():
    """tiny-llama has 4 query heads and 2 key heads: flash_attn serves the groups natively, so no
    key is repeated to the query's heads, and each layer calls the kernel once each way."""
    found = models.resolve(FLASH)
    assert not found.cpu  # a CPU has no FlashAttention kernel: predicted, not measured there
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = found.build(Shapes(batch_size=2, seq_len=16))
        ids = torch.randint(0, 1024, (2, 16))
        with Calls() as calls:
            model(input_ids=ids, labels=ids).loss.backward()
    assert (
        calls.seen == [("_flash_attention_forward", 2)] * 2 + [("_flash_attention_backward", 2)] * 2
    )


def test_a_named_flash_attention_is_predicted_and_says_how():
    out = predict(spec(FLASH, batch_size=2, seq_len=32))
    assert out.ok, out.message
    assert "flash_attention_2 (as named; PyTorch's FlashAttention-2 kernel" in out.message


def test_a_cpu_tensor_has_no_flash_kernel_and_says_so():
    run = spec(FLASH, batch_size=1, seq_len=8)
    assert Recipe.of(run, torch.device("cpu")).unsupported() == (
        f"model {FLASH}: FlashAttention has no CPU kernel; it is predicted (bench predict) and "
        "runs on CUDA"
    )
    model = models.resolve(FLASH).build(Shapes(batch_size=1, seq_len=8))
    with pytest.raises(RuntimeError, match="FlashAttention runs on CUDA only; name sdpa"):
        model(input_ids=torch.randint(0, 1024, (1, 8)))


def test_flash_attention_on_a_model_transformers_has_no_flash_path_for_is_refused_by_name():
    with pytest.raises(KeyError, match="T5ForConditionalGeneration has no FlashAttention path"):
        models.resolve("hf:suites/configs/tiny-t5#seq2seq-lm,attn_implementation=flash_attention_2")


@pytest.mark.cuda
def test_a_named_flash_attention_on_cuda_is_predicted_to_the_byte():
    record = isolated(
        spec(FLASH, batch_size=8, seq_len=64), Device("cuda", torch.cuda.get_device_name(0))
    )
    assert record["status"] == "ok", record
    assert record["peak_tensor_bytes"] == record["predicted_peak_tensor_bytes"]
