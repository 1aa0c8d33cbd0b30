"""What the fork server (bench.launch.process) imports once, so that every forked run finds it
imported.

Nothing here may start CUDA: a child forked from a process that has cannot use it. Two imports
would: torchao asks for the GPU's properties as it loads, and transformers imports torchao when it
is installed. So torchao stays hidden from transformers while the server imports it (transformers
then leaves out its own torchao integration, which no technique uses) and is left for a run that
needs it to import itself.
"""

import sys

sys.modules["torchao"] = None  # type: ignore[assignment]  importlib.util.find_spec reads this as "not installed"
try:
    import sklearn.datasets  # noqa: F401  the fidelity phase's digits
    import torchvision.models  # noqa: F401  (and torch._dynamo, which it imports)

    import bench.worker  # noqa: F401  torch, and the harness itself

    try:
        import transformers.models.bert.modeling_bert  # noqa: F401  about 4 s of a BERT run's start
    except ImportError:
        pass
finally:
    del sys.modules["torchao"]
