"""What the ISA-variant plugins (avx512.py, avx2.py) share: skipping a run that does not apply here,
and loading the variant's kernels at the start of a session, checked by their panel width."""

from __future__ import annotations

import pytest


def skip_all(items: list[pytest.Item], reason: str) -> None:
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        item.add_marker(skip)


def load_variant(name: str, panel_width: int) -> None:
    """Builds and loads the kernels as the plugin configured them; a usage error if they did not
    build or are not the variant asked for (its panels of `panel_width` columns)."""
    import torch

    from tokenmill.kernels import build

    if not build.load():
        raise pytest.UsageError(f"the {name} kernels did not build (see the log above)")
    width = torch.ops.tokenmill.linear_panel_width()
    if width != panel_width:
        raise pytest.UsageError(f"{name} kernels have panels of {width} columns, not {panel_width}")
