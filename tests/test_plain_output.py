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
