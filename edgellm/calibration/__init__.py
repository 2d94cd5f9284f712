"""Calibration text for sensitivity measurement (edgellm.sensitivity).

`builtin.txt` was written for the project: short English paragraphs of several registers (a
description, a recipe, an explanation, a letter, a Q&A, history, minutes) and a few small code
snippets (Python, C, SQL), about 1.7k tokens with a Llama/SmolLM2 tokenizer. It is mixed on purpose:
a layer that only hurts code or only hurts prose still shows up in the mean KL.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError

__all__ = ["load_calibration", "BUILTIN", "MAX_CALIBRATION_BYTES"]

BUILTIN = "builtin"
MAX_CALIBRATION_BYTES = 16 << 20   # calibration is a few KiB; a bigger file is a wrong path


def load_calibration(name_or_path: str | os.PathLike = BUILTIN) -> str:
    """The calibration text: "builtin" (the corpus shipped with edgellm) or a UTF-8 text file.
    ConfigError for a file that is missing, too big, not UTF-8 or empty."""
    if isinstance(name_or_path, str) and name_or_path == BUILTIN:
        path = Path(__file__).with_name("builtin.txt")
    else:
        path = Path(name_or_path)
    try:
        if path.exists() and not path.is_file():   # a device or pipe: stat says 0 bytes, reading never ends
            raise ConfigError(f"{path}: calibration text must be a regular file")
        size = path.stat().st_size
        if size > MAX_CALIBRATION_BYTES:
            raise ConfigError(f"{path}: calibration text is {size} bytes; expected at most "
                              f"{MAX_CALIBRATION_BYTES} (a few KiB of text is enough)")
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the calibration text: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: calibration text must be UTF-8; byte {e.start} is not") from None
    if not text.strip():
        raise ConfigError(f"{path}: calibration text is empty")
    return text
