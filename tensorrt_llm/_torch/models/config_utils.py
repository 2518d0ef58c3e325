"""Reading HF-style ``config.json`` files into frozen dataclasses, with errors that name the key."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from tensorrt_llm.logger import logger


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


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """``generation_config.json`` of ``model_dir`` ({} when there is none)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object")
    return data


def token_ids(value: Any, where: str) -> tuple[int, ...]:
    """An end id given as an int or a list of ints (None: none)."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}={value!r} must be a token id or a list of token ids")
    return tuple(values)


def warn_unknown(keys: set[str], where: str) -> None:
    if keys:
        logger.warning("%s: ignoring unknown key(s) %s", where, sorted(keys))


def check_model_type(data: dict[str, Any], *allowed: str) -> None:
    model_type = data.get("model_type", allowed[0])
    if model_type not in allowed:
        raise ValueError(f"config.json: model_type={model_type!r}; expected one of {allowed}")


def check_per_layer(
    where: str, key: str, values: tuple[str, ...], num_layers: int, allowed: tuple[str, ...]
) -> None:
    if len(values) != num_layers:
        raise ValueError(
            f"{where}: {key} has {len(values)} entries for num_hidden_layers={num_layers}"
        )
    bad = sorted({v for v in values if v not in allowed})
    if bad:
        raise ValueError(f"{where}: {key} has {bad}; expected entries in {list(allowed)}")


def checkpoint_dtype(*configs: dict[str, Any]) -> str:
    """The model's dtype: the first of ``configs`` (outer first, as transformers) that names one."""
    for source in configs:
        for key in ("dtype", "torch_dtype"):
            if source.get(key) is not None:
                return str(source[key]).removeprefix("torch.")
    return "float32"  # transformers' default when a config names none


def check_numbers(config, where: str, may_be_zero: tuple[str, ...] = ()) -> None:
    """Every ``int`` field of the dataclass ``config`` a positive int (those of ``may_be_zero``:
    an int >= 0) and every ``float`` field a positive number; else a ``ValueError`` naming it."""
    for f in fields(config):
        value = getattr(config, f.name)
        if f.type == "int":
            low = 0 if f.name in may_be_zero else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                rule = "an int >= 0" if low == 0 else "a positive int"
                raise ValueError(f"{where}: {f.name}={value!r} must be {rule}")
        elif f.type == "float" and not (isinstance(value, int | float) and value > 0):
            raise ValueError(f"{where}: {f.name}={value!r} must be a positive number")
