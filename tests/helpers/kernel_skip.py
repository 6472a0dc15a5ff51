"""specbuild's CPU kernels in tests: skip where they cannot be built, fail where a compiler exists
but the build failed (that is a bug, not a missing tool)."""

from __future__ import annotations

import pytest

from specbuild.model import cpu_kernels


def kernels_or_skip() -> None:
    st = cpu_kernels.status()
    if not st["available"] and cpu_kernels._compiler() is not None:
        pytest.fail(f"a compiler exists but the kernels did not build: {st['reason']}")
    if not st["available"]:
        pytest.skip(st["reason"])
