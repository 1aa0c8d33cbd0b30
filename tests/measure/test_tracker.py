import torch

from bench.measure.allocator import CachingAllocator
from bench.measure.host import on_host
from bench.measure.memory import tensor_bytes, tracked_step
from bench.measure.tracker import LiveBytes
from tests.helpers import MLP_PARAM_BYTES, mlp_step

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


def test_a_storage_resized_in_place_is_freed_and_allocated_as_the_allocator_sees_it():
    """FSDP2 frees an unsharded parameter by resizing its storage to nothing and gathers into it
    again by resizing it back; no operator is dispatched for either. Each resize ends the bytes the
    storage held and counts those it holds, one life each, as the caching allocator frees and
    allocates them; its last life ends when it dies. Outside a tracker, resize_ is torch's own."""
    original = torch.UntypedStorage.resize_
    tracker = LiveBytes(CPU)
    with tracker:
        a = torch.zeros(1000)  # 4000 bytes
        a.untyped_storage().resize_(0)
        assert tracker.current == 0
        a.untyped_storage().resize_(8000)
        assert tracker.current == 8000
        ahead = torch.empty(0)
        ahead.untyped_storage().resize_(2000)  # grown, never counted: its device's, from now
        assert tracker.current == 10000
    assert tracker.peak == 10000 and torch.UntypedStorage.resize_ is original
    assert [life[0] for life in tracker._lives] == [4000, 8000, 0, 2000]
    del a, ahead
    assert tracker.current == 0


def test_a_tensor_marked_as_on_the_host_is_not_counted():
    """A prediction's fake CPU tensors stand for CUDA ones; the few CUDA keeps on the host are
    marked so."""
    tracker = LiveBytes(CPU)
    state = [torch.zeros(1000), on_host(torch.zeros(())), on_host(torch.zeros(()))]
    tracker.add(state, "optimizer_state")
    assert tracker.current == 4000


def test_stepping_aside_leaves_what_the_block_makes_uncounted_but_still_counts_what_it_frees():
    """Compiled code cannot run under a dispatch mode, so the tracker steps aside for it (torchao's
    update)."""
    tracker = LiveBytes(CPU)
    with tracker:
        kept = torch.zeros(100)
        with tracker.stepped_aside():
            unseen = torch.zeros(1000)
            del kept
        assert tracker.current == 0
        seen = torch.zeros(10)
    assert (tracker.peak, tracker.current) == (400, 40)
    del unseen, seen


def test_mlp_step_under_adam_matches_the_analytic_figures():
    """Linear(64→256)→ReLU→Linear(256→10), batch 32, AdamW after its first step."""
    model, opt, step = mlp_step(torch.optim.AdamW, foreach=False)
    figures = tracked_step(step, model, opt, CPU)
    params = MLP_PARAM_BYTES
    assert figures.param_bytes == params
    # exp_avg, exp_avg_sq, 4 fp32 step counters
    assert figures.optimizer_state_bytes == 2 * params + 4 * 4
    # Held from forward into backward: the ReLU output (ReLU saves its result, the second Linear its
    # input: one storage) and the logits. The first Linear's output is freed once ReLU has run, and
    # the input x existed before the step.
    assert figures.activation_bytes == 32 * 256 * 4 + 32 * 10 * 4
    # Here the peak comes in the optimizer step: model states, all gradients, and AdamW's
    # per-parameter temporaries (64 KiB for the first weight) outweigh the 33 KiB of activations
    # held in backward.
    assert figures.peak_phase == "optimizer"
    # What was alive at that peak, exactly: the model states, and two temporaries the size of the
    # first weight (AdamW's per-parameter update); the activations were freed in backward.
    assert {k: v for k, v in figures.flat().items() if k.startswith("at_peak_")} == {
        "at_peak_parameters_bytes": params,
        "at_peak_buffers_bytes": 0,
        "at_peak_gradients_bytes": params,
        "at_peak_optimizer_state_bytes": 2 * params + 16,
        "at_peak_activations_bytes": 0,
        "at_peak_temporaries_bytes": 2 * 64 * 256 * 4,
    }
    assert (
        sum(v for k, v in figures.flat().items() if k.startswith("at_peak_"))
        == figures.peak_tensor_bytes
    )
    x = torch.randn(32, 64)
    assert tensor_bytes([x, x[1:]]) == x.numel() * 4  # a view shares its tensor's storage


def test_at_peak_splits_what_forward_made_from_what_backward_made():
    """A forward-only peak holds the activations; the labels follow the phase a storage was made
    in."""
    tracker = LiveBytes(CPU)
    weight = torch.ones(100)
    tracker.add([weight], "parameters")
    with tracker:
        tracker.phase = "forward"
        kept = torch.zeros(50)  # 200 bytes, alive at the peak
        gone = torch.zeros(25)  # 100 bytes, alive at the peak, freed before the end
        del gone
        tracker.phase = "backward"
        after = torch.zeros(10)  # made after the peak (current is lower): not part of it
    assert tracker.peak == 400 + 200 + 100
    assert tracker.at_peak() == {"parameters": 400, "forward": 300}
    del kept, after


def test_cuda_overheads_split_context_from_cache_slack():
    from bench.measure.memory import overheads
    from bench.record import Memory

    figures = Memory(peak_allocated_bytes=700, peak_reserved_bytes=1000, nvml_process_bytes=1500)
    assert overheads(figures) == Memory(cache_slack_bytes=300, context_bytes=500)
    assert overheads(Memory(peak_allocated_bytes=1, peak_reserved_bytes=2)) == Memory(
        cache_slack_bytes=1
    )


MiB = 1 << 20


def _reserved(tracker: LiveBytes) -> int:
    allocator = CachingAllocator()
    tracker.replay(allocator)
    return allocator.peak_reserved


def test_a_replay_after_its_history_starts_from_the_segments_the_history_left():
    """A first step makes the optimizer's state while its activations are alive, in a segment of its
    own; the next step's larger request finds neither free. Replayed alone, the state would come
    first and the step's request would take one segment beside it: 36 MiB reserved, where the card
    reserved 48."""
    kept = {}

    def first() -> None:
        activations = torch.empty(12 * MiB, dtype=torch.uint8)
        kept["state"] = torch.empty(12 * MiB, dtype=torch.uint8)
        del activations

    def step() -> None:
        torch.empty(24 * MiB, dtype=torch.uint8)

    history = LiveBytes(torch.device("cpu"), 512)
    with history:
        first()
    trackers = []
    for follow in (False, True):
        tracker = LiveBytes(torch.device("cpu"), 512)
        tracker.add([kept["state"]], "optimizer_state")
        if follow:
            tracker.follow(history)
        with tracker:
            step()
        trackers.append(tracker)
    assert [_reserved(t) for t in trackers] == [36 * MiB, 48 * MiB]


def _parts(tracker: LiveBytes, n: int, keep_every: bool = False) -> list[torch.Tensor]:
    """``n`` parts of a loop like accumulation's: a part makes a temporary, a carried total that
    the next part frees, and (``keep_every``) a tensor it keeps; each marked at its end."""
    gradient, total, kept = torch.zeros(64), None, []
    with tracker:
        for _ in range(n):
            temporary = torch.ones(256)
            gradient += temporary[:64]
            total = temporary.sum() if total is None else total + temporary.sum()
            del temporary
            if keep_every:
                kept.append(torch.zeros(32))
            tracker.mark()
        after = torch.zeros(512)  # what follows the loop (an optimizer step)
        del after, total
    return kept


def _allocations(tracker: LiveBytes) -> list[tuple[bool, int]]:
    return [(freeing, n) for _, freeing, _, n in tracker._events()]


def test_a_loop_traced_four_times_and_repeated_is_the_loop_traced_whole():
    whole, folded = LiveBytes(CPU), LiveBytes(CPU)
    _parts(whole, 9)
    _parts(folded, 4)
    assert folded.repeat(5)
    assert _allocations(folded) == _allocations(whole)
    assert (folded.peak, folded.at_peak()) == (whole.peak, whole.at_peak())
    allocators = [CachingAllocator(None), CachingAllocator(None)]
    for tracker, allocator in zip((whole, folded), allocators):
        tracker.replay(allocator)
    assert allocators[0].peak_reserved == allocators[1].peak_reserved


def test_a_loop_whose_parts_keep_what_they_make_does_not_repeat_and_is_left_alone():
    tracker = LiveBytes(CPU)
    kept = _parts(tracker, 4, keep_every=True)
    lives = [list(life) for life in tracker._lives]
    assert not tracker.repeat(5)  # its memory grows with every part: only a whole trace says how
    assert tracker._lives == lives
    del kept


def _decodes(tracker: LiveBytes, n: int, after: int = 0) -> None:
    """``n`` passes of a loop like generate()'s, each marked as it begins: attention's scores over
    the cache so far, the cache and the ids a token longer (the old ones freed); the loop's last
    check marked too, then ``after`` bytes made (none, in generate()); all freed as it returns."""
    cache, ids = torch.zeros(1000), torch.zeros(10, dtype=torch.long)
    with tracker:
        for _ in range(n):
            tracker.mark()
            scores = torch.ones(cache.numel() // 10)
            cache = torch.cat([cache, torch.zeros(250)])  # 1,000 bytes a token
            ids = torch.cat([ids, torch.zeros(1, dtype=torch.long)])
            del scores
        tracker.mark()
        made = [torch.zeros(after // 4)] if after else []
    del cache, ids, made


def test_a_loop_that_grows_by_a_token_a_pass_is_grown_to_the_loop_traced_whole():
    """generate()'s decode forwards: each pass makes what the one before made, a token longer; the
    last three traced show by how much, and the repeats grow by as much again each, rounded as the
    tracker rounds, their peak counted again (it falls in the last pass, not a traced one)."""
    whole, folded, plain = LiveBytes(CPU, 512), LiveBytes(CPU, 512), LiveBytes(CPU, 512)
    for tracker, passes in ((whole, 14), (folded, 5), (plain, 5)):
        _decodes(tracker, passes)
    assert not plain.repeat(9)  # bytes that grow do not repeat unless asked to
    assert folded.repeat(9, growing=True)
    assert _allocations(folded) == _allocations(whole)
    assert (folded.peak, folded.at_peak(), folded.phase_peaks) == (
        whole.peak,
        whole.at_peak(),
        whole.phase_peaks,
    )
    assert folded._raw == whole._raw
    allocators = [CachingAllocator(None), CachingAllocator(None)]
    for tracker, allocator in zip((whole, folded), allocators):
        tracker.replay(allocator)
    assert allocators[0].peak_reserved == allocators[1].peak_reserved


def test_a_growing_loop_followed_by_what_no_pass_makes_is_left_alone():
    tracker = LiveBytes(CPU, 512)
    _decodes(tracker, 5, after=4096)  # how that grows with the passes, no pass says
    lives = [list(life) for life in tracker._lives]
    assert not tracker.repeat(9, growing=True)
    assert tracker._lives == lives


class CountingAllocator(CachingAllocator):
    def __init__(self) -> None:
        super().__init__(None)
        self.requests = 0

    def malloc(self, handle, size, address=None) -> None:
        self.requests += 1
        super().malloc(handle, size, address)


def test_a_replay_skips_the_repeats_once_the_allocator_comes_round_to_a_state_it_had():
    """Each repeat asks the same of the allocator; once its state at a repeat's end is one it had
    at an earlier end, the rest come round with that period, so whole periods are skipped: the
    same peaks, the same blocks held at the end, for a fraction of the requests."""
    whole, folded = LiveBytes(CPU), LiveBytes(CPU)
    _parts(whole, 64)
    _parts(folded, 4)
    assert folded.repeat(60)
    allocators = [CountingAllocator(), CountingAllocator()]
    for tracker, allocator in zip((whole, folded), allocators):
        tracker.replay(allocator)
    a, b = allocators
    assert (a.peak_reserved, a.peak_allocated) == (b.peak_reserved, b.peak_allocated)
    assert a.state({}) == b.state({})  # what is held and cached at the end, where
    assert b.requests < a.requests / 4
