"""What the fork server (bench.launch.process) imports once, so that every forked run finds it
imported: the harness and torch always, and the modules ``PRELOAD_IMPORTS`` names: the
sweep's models' own (torchvision's, transformers' model code), so that a ResNet sweep does not wait
on transformers, nor a BERT one on torchvision.

Nothing here may start CUDA: a child forked from a process that has cannot use it. Two imports
would: torchao asks for the GPU's properties as it loads, and transformers imports torchao when it
is installed. So torchao stays hidden from transformers while the server imports it (transformers
then leaves out its own torchao integration, which no technique uses) and is left for a run that
needs it to import itself.
"""

import importlib
import os
import sys

sys.modules["torchao"] = None  # type: ignore[assignment]  importlib.util.find_spec reads this as "not installed"
try:
    import torch._dynamo  # noqa: F401  what compiling runs, torchvision and transformers import

    import bench.worker  # noqa: F401  torch, and the harness itself
    from bench.launch.process import PRELOAD_IMPORTS

    for name in filter(None, os.environ.get(PRELOAD_IMPORTS, "").split(",")):
        try:
            importlib.import_module(name)
        except ImportError:  # an optional package: the run that needs it says so
            pass
finally:
    del sys.modules["torchao"]
