import multiprocessing
import time

import pytest

from bench.advise.predictions import Predictions
from tests.helpers import spec

RUN = spec("vit-tiny", batch_size=4)


def _holds_then_makes(folder, key, holding, release):
    """Another process making the prediction of ``key``: it holds its lock until told, then stores
    a result and lets go."""
    other = Predictions("cpu", folder, jobs=1)
    with other._made_once([key]):
        holding.set()
        release.wait(60)
        (folder / f"{key}.json").write_text('{"made": "elsewhere"}')


def test_a_prediction_another_process_is_making_is_waited_for_and_read_not_made_again(tmp_path):
    mine = Predictions("cpu", tmp_path, jobs=1)
    key = mine._key({"predict": RUN.to_dict()})
    context = multiprocessing.get_context("fork")
    holding, release = context.Event(), context.Event()
    other = context.Process(target=_holds_then_makes, args=(tmp_path, key, holding, release))
    other.start()
    assert holding.wait(60)
    # let the other process finish once this one is waiting on its lock
    context.Process(target=lambda: (time.sleep(2), release.set())).start()
    made = mine._each(
        [RUN], lambda *a: pytest.fail("made twice"), lambda s: {"predict": s.to_dict()}
    )
    other.join(60)
    assert made == [{"made": "elsewhere"}] and (mine.made, mine.reused) == (0, 1)


def test_a_prediction_no_other_process_holds_is_made_here_then_read(tmp_path):
    calls = []
    mine = Predictions("cpu", tmp_path, jobs=1)
    job = lambda *a: calls.append(a) or {"made": "here"}  # noqa: E731
    keyed = lambda s: {"predict": s.to_dict()}  # noqa: E731
    assert mine._each([RUN], job, keyed) == [{"made": "here"}]
    assert mine._each([RUN], job, keyed) == [{"made": "here"}] and len(calls) == 1
