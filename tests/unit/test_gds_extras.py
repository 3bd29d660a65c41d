"""The ``gds`` extras install the kvikio build of each CUDA major version (kvikio publishes ``kvikio-cu12`` and
``kvikio-cu13``; one extra that named only ``kvikio-cu12`` could not serve a CUDA 13 machine)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.timeout(10)
def test_one_gds_extra_per_cuda_major_names_its_kvikio_build() -> None:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    gds = {name: deps for name, deps in extras.items() if name.startswith("gds")}
    assert gds == {"gds-cu12": ["kvikio-cu12"], "gds-cu13": ["kvikio-cu13"]}
