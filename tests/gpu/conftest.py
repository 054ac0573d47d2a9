"""The GPU backend's Triton kernels run on a GPU where there is one, else on Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test
module imports a kernel module (they import them lazily, through `tests.gpu.steps.kernels`,
which checks that it took effect). Every test in this directory is skipped, saying why, when
triton cannot be imported.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401
    MISSING = None
except ImportError as error:
    MISSING = f"triton cannot be imported ({error}); install the gpu extra: pip install -e '.[gpu]'"


def pytest_collection_modifyitems(config, items):
    if MISSING is None:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=MISSING))
