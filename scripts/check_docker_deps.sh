#!/usr/bin/env bash
# Checks that the install commands of Dockerfile.cuda resolve, without Docker:
# the same requirements, read out of pyproject.toml the same way, through `pip install --dry-run`.
#   bash scripts/check_docker_deps.sh
# (The image takes torch from the CUDA wheel index; here torch resolves from PyPI, whose default
# Linux wheel is the CUDA build too.)
set -euo pipefail
cd "$(dirname "$0")/.."
req=$(mktemp)
python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['wandb']))" > "$req"
grep -q '^torch' "$req"
python3 -m pip install --quiet --dry-run --ignore-installed --report /dev/null -r "$req"
echo "Dockerfile.cuda requirements resolve: $(wc -l < "$req") direct requirements"
# the vLLM venv's pin exists (its own dependency tree, several GB, is vLLM's to resolve)
vllm=$(sed -n 's/^ARG VLLM_VERSION=//p' Dockerfile.cuda)
python3 -m pip install --quiet --dry-run --no-deps --ignore-installed --report /dev/null "vllm==$vllm"
echo "Dockerfile.cuda vllm==$vllm is on the index"
rm -f "$req"
