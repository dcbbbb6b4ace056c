"""The bundled calibration and evaluation texts: present, intact, distinct, and the CLI defaults."""

from __future__ import annotations

import hashlib

from click.testing import CliRunner

from brisk.bench.prompts import bench_text
from brisk.cli import main
from brisk.data import calibration_text_path, evaluation_text_path

# The sha256 of the texts as published (src/brisk/data/README.md); a re-encoded or truncated copy fails here.
SHA256 = {
    "emma.txt": "7c67b5985c6d0de1efaeb5d342d52cb82c38083c40e2295129e30e87ee690ebe",
    "sense_and_sensibility.txt": "105e1651fe93bed7130078578efd31e0c557d68667ba672ddc876f735b30fe09",
}


def test_texts_ship_intact() -> None:
    for path in (calibration_text_path(), evaluation_text_path()):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256[path.name], path.name
    assert calibration_text_path() != evaluation_text_path()


def test_benchmark_prompts_come_from_the_evaluation_text() -> None:
    # The 40 kB benchmark prompts have always been cut from (sha256 of the former bundled excerpt).
    text = bench_text()
    assert text.startswith("CHAPTER 1") and text in evaluation_text_path().read_text(encoding="utf-8")
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "b9142cf368c36778d44dbe70d982248b5c5a545a0430a17f95288fe72c3583cf")


def test_cli_text_options_default_to_the_right_text() -> None:
    from brisk.cli import main as cli

    def default(path: list[str], option: str) -> str:
        command = cli
        for name in path:
            command = command.commands[name]  # type: ignore[attr-defined]
        return next(p.default for p in command.params if p.name == option)

    calibration, evaluation = str(calibration_text_path()), str(evaluation_text_path())
    assert default(["quantize"], "calib_text") == calibration
    assert default(["prune"], "calib_text") == calibration
    assert default(["spec", "layerskip-search"], "text_path") == calibration
    assert default(["eval", "ppl"], "text_path") == evaluation
    assert default(["bench", "quant"], "text_path") == evaluation
    help_text = " ".join(CliRunner().invoke(main, ["eval", "ppl", "--help"]).output.split())
    assert "Sense and Sensibility" in help_text
