"""activation-offload: saved activations to the host on a side stream, prefetched in backward
(CUDA); its prediction on fake tensors, and on a GPU its gradients against the plain model's."""

import pytest
import torch

from bench.measure.memory import tracked_step
from bench.predict.fake import predict
from bench.recipe import Recipe
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, tech


def test_a_cpu_run_is_unsupported_with_the_reason():
    run = spec("vit-tiny", (tech("activation-offload"),))
    assert Recipe.of(run, CPU).unsupported() == (
        "activation-offload: copies on a side CUDA stream; on a CPU activations live in host "
        "memory already"
    )


def test_predicted_as_cuda_it_leaves_the_device_the_small_saved_tensors_only():
    """vit-tiny at batch 16: what forward leaves for backward falls from about 1.9 MiB to the
    tensors under min_bytes (1,024 bytes: norms' statistics, scalars), as save_on_cpu's does to
    nothing; raising min_bytes past every saved tensor keeps them all, as without the technique."""

    def held(*techniques):
        return predict(spec("vit-tiny", techniques, batch_size=16)).activation_bytes

    plain, overlapped = held(), held(tech("activation-offload"))
    assert overlapped < 0.05 * plain
    assert held(tech("activation-offload", min_bytes=1 << 40)) == plain


@pytest.mark.cuda
def test_on_a_gpu_the_gradients_are_the_plain_models_and_the_saves_leave_the_device():
    cuda = torch.device("cuda")
    grads = {}
    for name, techniques in (("plain", ()), ("offloaded", (tech("activation-offload"),))):
        trainer, batch = build_trainer(spec("vit-tiny", techniques, batch_size=16, lr=0.0), cuda)
        torch.manual_seed(0)
        trainer.step(batch)
        figures = tracked_step(
            lambda t=trainer, b=batch: t.step(b), trainer.model, trainer.optimizer, cuda
        )
        grads[name] = (figures, [p.grad for p in trainer.model.parameters()], trainer.proof())
    assert grads["offloaded"][0].activation_bytes < 0.1 * grads["plain"][0].activation_bytes
    for offloaded, plain in zip(grads["offloaded"][1], grads["plain"][1]):
        # vit-tiny has no dropout
        torch.testing.assert_close(offloaded, plain)
    proof = grads["offloaded"][2]
    assert proof["activation-offload.tensors_offloaded_per_step"] > 0
    assert proof["activation-offload.tensors_prefetched_per_step"] > 0
