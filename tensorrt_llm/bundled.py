"""The bundled MiniMax-M3-tiny target and Eagle3 drafter (``examples/models/m3-tiny``)."""

from __future__ import annotations

from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parents[1] / "examples" / "models" / "m3-tiny"
BUNDLED_TARGET = BUNDLED_DIR / "target"
BUNDLED_DRAFT = BUNDLED_DIR / "eagle3"


def bundled_target() -> str:
    if not (BUNDLED_TARGET / "config.json").is_file():
        raise ValueError(
            f"model was not given and the bundled checkpoint is missing at {BUNDLED_TARGET}"
        )
    return str(BUNDLED_TARGET)
