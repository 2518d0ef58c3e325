"""Reading HF-style ``config.json`` files into frozen dataclasses, with errors that name the key."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any


def read_config_json(model_dir: str | Path, argument: str) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{argument}={str(model_dir)!r}: no config.json there")
    return json.loads(path.read_text())


def known_kwargs(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    """The entries of ``data`` that are fields of ``cls`` (others are ignored, as HF does); missing
    required fields are an error."""
    required = [
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    ]
    missing = [name for name in required if name not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def check_positive_ints(config: object, where: str) -> None:
    """Every field annotated ``int`` must hold a positive int."""
    for f in fields(config):
        value = getattr(config, f.name)
        if f.type == "int" and (
            not isinstance(value, int) or isinstance(value, bool) or value <= 0
        ):
            raise ValueError(f"{where}: {f.name}={value!r} must be a positive int")
