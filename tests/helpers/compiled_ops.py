"""The ``compiled`` fixture: the compiled ops, built for this CPU and, on an AVX-512 CPU, for AVX2
too (``conftest.kernel_builds``); a skip where they cannot be built. Import it into a test module
to use it there (module-scoped: each module builds once per build)."""

from __future__ import annotations

import pytest

from conftest import kernel_builds, kernels_built_for
from splitserve.layers.ops import CompiledOps


@pytest.fixture(scope="module", params=kernel_builds())
def compiled(request):
    """The compiled ops of one build."""
    with kernels_built_for(request.param) as module:
        if module is None:
            pytest.skip("the compiled kernels cannot be built here (see the warning logged by layers/kernels.py)")
        yield CompiledOps(module)
