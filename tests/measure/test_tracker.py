import torch
from torch import nn

from bench.measure.memory import tensor_bytes, tracked_step
from bench.measure.tracker import LiveBytes

CPU = torch.device("cpu")


def test_counts_new_storages_once_and_uncounts_them_when_freed():
    tracker = LiveBytes(CPU)
    with tracker:
        a = torch.zeros(1000)  # 4000 bytes
        view = a[10:20]  # same storage: not counted again
        b = torch.ones(250, dtype=torch.float64)  # 2000 bytes
        assert tracker.current == 6000
        del a, view
        assert tracker.current == 2000
    assert tracker.peak == 6000
    del b
    assert tracker.current == 0


def test_mlp_step_under_adam_matches_the_analytic_figures():
    """Linear(64→256)→ReLU→Linear(256→10), batch 32, AdamW after its first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step():
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    figures = tracked_step(step, model, opt, CPU)
    params = (64 * 256 + 256 + 256 * 10 + 10) * 4
    assert figures["param_bytes"] == params
    assert figures["optimizer_state_bytes"] == 2 * params + 4 * 4  # exp_avg, exp_avg_sq, 4 fp32 step counters
    # Held from forward into backward: the ReLU output (ReLU saves its result, the second Linear its
    # input: one storage) and the logits. The first Linear's output is freed once ReLU has run, and
    # the input x existed before the step.
    assert figures["activation_bytes"] == 32 * 256 * 4 + 32 * 10 * 4
    # Here the peak comes in the optimizer step: model states, all gradients, and AdamW's per-parameter
    # temporaries (64 KiB for the first weight) outweigh the 33 KiB of activations held in backward.
    assert figures["peak_phase"] == "optimizer"
    assert tensor_bytes([x, x[1:]]) == x.numel() * 4


def test_cuda_overheads_split_context_from_cache_slack():
    from bench.measure.memory import overheads

    figures = {"peak_allocated_bytes": 700, "peak_reserved_bytes": 1000, "nvml_process_bytes": 1500}
    assert overheads(figures) == {"cache_slack_bytes": 300, "context_bytes": 500}
    assert overheads({"peak_allocated_bytes": 1, "peak_reserved_bytes": 2, "nvml_process_bytes": None}) == {
        "cache_slack_bytes": 1}
