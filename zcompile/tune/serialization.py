"""Option values as a tune result's JSON holds them: dtypes by name, schedule policies by name."""

from __future__ import annotations

import json
from typing import Any

import torch

from zcompile.passes.schedule import policy_name


def jsonable_value(value: Any) -> Any:
    """A value as JSON holds it: dtypes by name (``"bfloat16"``, which ZeroConfig reads), a policy by
    name, a device mesh by its dims and shape (``"mesh dp=2 tp=2"``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(value, DeviceMesh):
        return "mesh " + " ".join(f"{n}={k}" for n, k in zip(value.mesh_dim_names or (), value.shape, strict=False))
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if callable(value):
        return policy_name(value)
    return value


def jsonable_options(options: dict[str, Any]) -> dict[str, Any]:
    """Options as JSON holds them; the process group (not a value) is left out."""
    return {name: jsonable_value(value) for name, value in options.items() if name != "group"}


def dumps_to(data: dict[str, Any], path: str | None = None) -> str:
    """``data`` as indented JSON; also written to ``path`` (with a final newline) when given."""
    text = json.dumps(data, indent=1)
    if path is not None:
        with open(path, "w") as handle:
            handle.write(text + "\n")
    return text
