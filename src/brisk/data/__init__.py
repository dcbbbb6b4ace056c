"""The texts brisk calibrates and evaluates on, shipped with the package (public domain; see README.md here).

Calibration (GPTQ, AWQ, SparseGPT, Wanda, the layer-skip search) reads *Emma*; evaluation (perplexity,
benchmark prompts) reads *Sense and Sensibility*. Keeping them apart is the point: a perplexity measured on
the text a model was calibrated on flatters the method.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

CALIBRATION_TEXT = "emma.txt"
EVALUATION_TEXT = "sense_and_sensibility.txt"


def _path(name: str) -> Path:
    # brisk is installed as plain files (a wheel or an editable install), so the resource is a real file and
    # its path can be handed to click options and to code that opens files by name.
    return Path(str(resources.files(__name__).joinpath(name)))


def calibration_text_path() -> Path:
    """Path of the calibration text (Jane Austen's *Emma*)."""
    return _path(CALIBRATION_TEXT)


def evaluation_text_path() -> Path:
    """Path of the held-out evaluation text (Jane Austen's *Sense and Sensibility*)."""
    return _path(EVALUATION_TEXT)
