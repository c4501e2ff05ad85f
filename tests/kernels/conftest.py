"""The kernel tests' module: every build this CPU runs (`builds.kernel_builds`), each test
once per build; skipped where the kernels could not be built (the PyTorch paths are a
supported mode; `.ci/run` fails a run whose build fails)."""

from __future__ import annotations

import pytest

from carpool import kernels as cpu_kernels
from tests.kernels.builds import build_id, kernel_builds


@pytest.fixture(scope="module", params=kernel_builds(), ids=build_id)
def kernels(request):
    module = cpu_kernels.load(capability=request.param)
    if module is None:
        pytest.skip("the C++ kernels could not be built here")
    return module
