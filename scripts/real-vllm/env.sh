# Sourced by the real-vLLM harness scripts: where the engine's environment and models live, and
# the one vLLM version the harness and the real-engine suite are written against.
# KVGATE_VLLM_HOME (default ~/.cache/kvgate-vllm) holds venv/ (vLLM's CPU build) and models/.
KVGATE_VLLM_VERSION=0.32.0
KVGATE_VLLM_HOME="${KVGATE_VLLM_HOME:-${HOME:-/tmp}/.cache/kvgate-vllm}"
KVGATE_VLLM_VENV="$KVGATE_VLLM_HOME/venv"
KVGATE_VLLM_MODELS="$KVGATE_VLLM_HOME/models"
KVGATE_VLLM_READY="$KVGATE_VLLM_VENV/.kvgate-vllm-$KVGATE_VLLM_VERSION"
