"""Output without a terminal: a path is printed whole on its own line, and Hugging Face progress bars are off."""

from __future__ import annotations

import io
import logging

from rich.console import Console
from transformers.utils import logging as hf_logging

from asyncgrpo_cli.config.models import print_export_notice, quiet_progress_bars, quiet_progress_bars_without_terminal


def test_export_notice_prints_a_long_folder_whole_on_its_own_line(tmp_path):
    out = tmp_path / ("a-long-cache-folder-name-" * 4) / "models" / "SmolLM2-135M-Instruct.Q4_1"
    console = Console(file=io.StringIO(), width=80, force_terminal=False)
    print_export_notice(console, tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", out)
    lines = console.file.getvalue().splitlines()
    assert len(str(out)) > 80 and f"  {out}" in lines  # one line, not wrapped at 80 columns, nothing cut
    assert lines[0].startswith("Exporting SmolLM2-135M-Instruct.Q4_1.gguf")


def test_progress_bars_are_off_without_a_terminal_and_warnings_still_show(caplog):
    assert hf_logging.is_progress_bar_enabled()
    with quiet_progress_bars(quiet=True):
        assert not hf_logging.is_progress_bar_enabled()
        bar = hf_logging.tqdm(range(3), desc="Loading weights")
        assert type(bar).__name__ == "EmptyTqdm"  # what transformers draws its bars with: nothing
        with caplog.at_level(logging.WARNING):
            hf_logging.get_logger("transformers.modeling_utils").warning("a real warning")
        assert "a real warning" in caplog.text
        from transformers import modeling_gguf_pytorch_utils as gguf_utils  # its bar bypasses transformers' switch
        stream = io.StringIO()
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...", file=stream):
            pass
        assert stream.getvalue() == ""
    assert hf_logging.is_progress_bar_enabled()  # restored
    stream = io.StringIO()
    for _ in gguf_utils.tqdm(range(3), desc="Converting", file=stream):
        pass
    assert "Converting" in stream.getvalue()
    with quiet_progress_bars(quiet=False):  # on a terminal the bars stay
        assert hf_logging.is_progress_bar_enabled()
    try:
        assert quiet_progress_bars_without_terminal(io.StringIO()) is True  # a log file
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def _cells_text(text: str) -> str:
    """What a wrapped table holds, joined: every character but spaces and box lines."""
    import re

    return re.sub(r"[\s│┃║|─━═╭╮╰╯┏┓┗┛┡┩└┘┌┐├┤┼]", "", text)


def test_the_summary_wraps_a_long_path_at_80_columns_instead_of_cutting_it(tmp_path):
    from asyncgrpo_cli.dashboard.panels import summarize, summary_panel

    out = tmp_path / ("a-long-output-folder-" * 3)
    curves = out / "training_curves.png"
    console = Console(file=io.StringIO(), width=80, force_terminal=False)
    console.print(summary_panel(summarize([{"step": 1, "reward": 0.5}], 3.0, out, "finished", curves)))
    text = console.file.getvalue()
    assert "…" not in text and str(curves).replace(" ", "") in _cells_text(text)


def test_the_doctor_table_wraps_a_long_fix_instead_of_cutting_it(capsys, monkeypatch):
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.doctor import report
    from asyncgrpo_cli.server.checks import Check, ServerFacts

    fix = "rollout.sampling_mask_fallback=true, or restart the server with --return-sampling-mask --enable-scale-out"
    monkeypatch.setattr(report, "evaluate", lambda *a, **k: [Check("sampling mask", "fail", "no mask", fix)])
    monkeypatch.setattr(report, "restart_command", lambda *a, **k: None)
    monkeypatch.setenv("COLUMNS", "80")
    facts = ServerFacts(url="http://127.0.0.1:9", reachable=False, error="refused")
    assert report.run_doctor(compose(["+recipe=smoke"]), facts=facts) == 1
    text = capsys.readouterr().out
    assert "…" not in text and fix.replace(" ", "") in _cells_text(text)


def test_the_sweep_table_wraps_the_job_folders(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from asyncgrpo_cli.cli import app

    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / ("a-long-sweep-folder-" * 3)
    result = CliRunner().invoke(app, ["train", "-m", "--cfg", "job", "+recipe=smoke", f"trainer.output_dir={out}",
                                      "rollout.temperature=0.7,1.0"])
    assert result.exit_code == 0, result.output
    table = result.output.rsplit("---", 1)[-1]  # after the jobs' YAML
    cells = _cells_text(table)
    assert "…" not in table and f"{out}/0".replace(" ", "") in cells and f"{out}/1".replace(" ", "") in cells
