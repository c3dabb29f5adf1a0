"""Where the package's messages send the reader: documents that ship with it.

Messages and docstrings name sections of the project's specification (``SPEC §7``), which does not ship
with the package. `cite_shipped` points them at the README's sections instead and drops references to
other unshipped documents; errors, warnings, doctor checks and ``config --doc`` pass their text through it.
"""

from __future__ import annotations

import re

#: Section of the (unshipped) specification -> the README section ("Rules and limits") that covers it.
README_SECTIONS: tuple[tuple[str, str], ...] = (
    (r"2(\.\d+)?", "Supported setups"), (r"7", "Sampling filters"), (r"3\.3(\.\d)?", "Log-probabilities and the loss"),
    (r"4(\.\d)?", "Staleness and concurrency"), (r"(6|11)(\.\d)?", "Packing and the token budget"),
    (r"(8|9)(\.\d)?", "GPUs, weight sync and LoRA"), (r"12", "Resuming"), (r"16(\.\d)?", "Defaults"),
    (r"13(\.\d)?", "Agent training: tools and environments"), (r"15(\.\d)?", "Trackers"),
    (r"14", "Supported model families"),
)
_SPEC_REF = re.compile(r"SPEC §([\d.]*\d)(?: '[^']*')?(?:, §?[\d.]*\d)*")
_UNSHIPPED_REFS = (re.compile(r"\s*\((?:SPEC |DESIGN\.md|CONFIG\.md|VLLM\.md|Appendix B)[^)§]*\)"),
                   re.compile(r"\s*\((?:SPEC )?(?:Appendix )?B\.\d+[^)]*\)"),
                   re.compile(r",?\s*(?:DESIGN\.md|CONFIG\.md|VLLM\.md)(?: §[\d.]*\d(?:, §[\d.]*\d)*)?"),
                   re.compile(r",?\s*(?:SPEC )?(?:Appendix )?\bB\.\d+"))


def cite_shipped(text: str) -> str:
    """``text`` with references to the specification's sections pointed at the README's sections, and
    references to documents that do not ship with the package dropped; each line keeps its indentation."""
    def readme(match: re.Match) -> str:
        section = match.group(1).rstrip(".")
        for pattern, name in README_SECTIONS:
            if re.fullmatch(pattern, section):
                return f"README: {name}"
        return "README"

    def one_line(line: str) -> str:
        indent = line[: len(line) - len(line.lstrip())]
        out = _SPEC_REF.sub(readme, line.lstrip())
        for ref in _UNSHIPPED_REFS:
            out = ref.sub("", out)
        out = re.sub(r"[ \t]{2,}", " ", re.sub(r"\(\s*\)", "", out))
        return indent + out.replace(" .", ".").replace(" ,", ",").rstrip()

    return "\n".join(one_line(line) for line in text.strip("\n").splitlines())
