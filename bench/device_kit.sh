#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on a lent GPU machine beyond what its image holds (Python 3.12
# with torch, transformers, peft, accelerate, triton, pandas, pyarrow...; nothing can be fetched
# there), downloaded here into .whl/ (git-ignored), at the versions this checkout's venv runs.
# bench/README.md ("gpu_check.py on a lent machine") gives the one command that uses them.
# Together with the working tree they must stay under the device call's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
# Missing from the image: pydantic (the spec), datasets (the data), bitsandbytes (8-bit AdamW and
# QLoRA rows), trl (the preference losses), soundfile (imported with the data code), and what they
# need that the image lacks.
packages="pydantic pydantic_core annotated_types typing_inspection datasets dill multiprocess bitsandbytes trl soundfile cffi pycparser"
pinned=$(.venv/bin/python - "$packages" <<'EOF'
import sys
from importlib.metadata import version

print(" ".join(f"{name.replace('_', '-')}=={version(name)}" for name in sys.argv[1].split()))
EOF
)
rm -rf .whl && mkdir .whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .whl --python-version 3.12 \
  --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  $pinned "liger-kernel>=0.6"
ls .whl
du -sh .whl
