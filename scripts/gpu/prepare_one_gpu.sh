#!/usr/bin/env bash
# Build everything scripts/gpu/stage_one_gpu.sh carries to a lent one-GPU machine (run here, where PyPI is reachable).
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED="${SHARED:-../shared}"                # the steering folder beside the checkout (../../shared from a worktree)
[ -d "$SHARED/device" ] || SHARED=../../shared
[ -d .stage/p08 ] || python3 "$SHARED/device/build_parts.py" .      # vLLM 0.26.0 parts (shared/device/README.md)
cp "$SHARED/device/install_on_device.sh" .stage/
[ -d .whl ] && [ -d .gguf/p1 ] || bash scripts/gpu/prepare.sh         # our wheels and the SmolLM2 GGUF
ray=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
mkdir -p /tmp/asyncgrpo_ray_dl
[ -f /tmp/asyncgrpo_ray_dl/$ray ] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 -d /tmp/asyncgrpo_ray_dl ray==2.60.0
sha256sum /tmp/asyncgrpo_ray_dl/$ray | cut -d' ' -f1 > scripts/gpu/ray_wheel.sha256
rm -rf .stage/ray && mkdir -p .stage/ray/r0 .stage/ray/r1 .stage/ray/r2 .stage/ray/r3
# Sizes chosen so that each piece fits beside what its call carries (64 MiB a call).
src=/tmp/asyncgrpo_ray_dl/$ray
dd if=$src of=.stage/ray/r0/$ray.part0 bs=1M count=9 status=none
dd if=$src of=.stage/ray/r1/$ray.part1 bs=1M skip=9 count=11 status=none
dd if=$src of=.stage/ray/r2/$ray.part2 bs=1M skip=20 count=12 status=none
dd if=$src of=.stage/ray/r3/$ray.part3 bs=1M skip=32 status=none
cat .stage/ray/r*/$ray.part* | sha256sum | cut -d' ' -f1 | diff - scripts/gpu/ray_wheel.sha256
# This checkout's code, for the device (the call sends the session's checkout; .stage/ travels when carried).
rm -rf .stage/code && mkdir -p .stage/code
git ls-files -co --exclude-standard | grep -v '^\.stage/' | tar cf - -T - | tar xf - -C .stage/code
du -sh .stage/p0* .stage/ray/* .whl .gguf/* .stage/code
