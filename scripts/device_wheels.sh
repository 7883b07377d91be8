#!/usr/bin/env bash
# Builds .whl/: the wheels that the lent GPU machine (Python 3.12, no package index there; its
# packages: scripts/device_packages.txt) lacks for `trainer serve`, the gpu/engine tests and the
# together==3.1.1 SDK client (with its tinker extra). The repo itself travels as source.
#   bash scripts/device_wheels.sh            # download into .whl/ (cp312, manylinux x86_64)
#   bash scripts/device_wheels.sh --check    # prove the set complete (here, no device needed)
# On the device (the repo root on PYTHONPATH too, so `trainer` runs from source):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Versions: the ones CI tests with. peft is carried although the device has one, because its
# version there is unknown (pyproject asks for a recent one).
#
# --check needs a Python whose environment holds the device's versions of its own packages
# (DEVICE_PY, default /tmp/devvenv/bin/python: torch 2.11.0, transformers 5.17.0, ...; see
# docs/gpu.md). From it, only the distributions named in scripts/device_packages.txt are linked
# into a bare site folder; a fresh venv of DEVICE_PY's interpreter (no site-packages) then gets
# .whl/ on top, and must import the server, the SDK and run a small test, with every
# requirement of every carried wheel met, then rehearse scripts/gpu_proof.sh. With a Python 3.12
# DEVICE_PY these are the very wheels the device gets; with another, the compiled ones are
# fetched again for its version.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  # the server: pyproject's dependencies that the device lacks
  fastapi==0.165.0
  starlette==1.10.0
  uvicorn==0.55.0
  pydantic==2.13.4
  pydantic-core==2.46.4
  annotated-types==0.7.0
  typing-inspection==0.4.2
  opentelemetry-api==1.45.2
  orjson==3.13.0
  pyrage==1.4.0
  llguidance==1.9.1
  peft==0.22.0
  # the SDK client: together[tinker]==3.1.1 and what it needs beyond the device's packages
  together==3.1.1
  tinker==0.23.1
  cyclopts==4.25.3
  detect-agent==0.6.0
  distro==1.9.0
  docstring-parser==0.18.0
  rich-rst==2.2.0
  sniffio==1.3.1
  types-pyyaml==6.0.12.20261122
  pyqwest==0.12.0
  zstandard==0.25.0
  h2==4.4.1
  hpack==4.2.0
  hyperframe==6.1.0
)
PLATFORMS=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

download() {  # download DEST PYVERSION SPEC...
  local dest=$1 pyver=$2
  shift 2
  for spec in "$@"; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" \
      --implementation cp "${PLATFORMS[@]}" -d "$dest" "$spec" 2> >(grep -v ' is ignored: ' >&2)
  done
}

if [[ "${1:-}" != "--check" ]]; then
  rm -rf .whl && mkdir -p .whl
  download .whl 3.12 "${WHEELS[@]}"
  n=$(find .whl -type f -name '*.whl' | wc -l)
  if [[ $n -ne ${#WHEELS[@]} ]]; then
    echo "expected ${#WHEELS[@]} wheels, got $n" >&2
    exit 1
  fi
  ls -1 .whl
  kib=$(du -sk .whl | cut -f1)
  echo ".whl: $n wheels, $((kib / 1024)) MiB ($kib KiB)"
  if ((kib > 32 * 1024)); then
    echo ".whl is over 32 MiB (a run carries 64 MiB in all)" >&2
    exit 1
  fi
  exit 0
fi

# --check
[[ -d .whl ]] || { echo "no .whl/: run bash scripts/device_wheels.sh first" >&2; exit 1; }
DEVICE_PY=${DEVICE_PY:-/tmp/devvenv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# 1. the device's own packages, and nothing else, out of DEVICE_PY's environment
"$DEVICE_PY" - "$work/base" scripts/device_packages.txt <<'EOF'
import importlib.metadata as md, os, re, sys
base, listing = sys.argv[1], sys.argv[2]
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wanted = {canon(w.strip()) for w in open(listing) if w.strip() and not w.startswith("#")}
linked = set()
for dist in md.distributions():
    name = canon(dist.metadata["Name"])
    if name not in wanted or name in linked or not dist.files:
        continue
    linked.add(name)
    for f in dist.files:
        src = dist.locate_file(f)
        dst = os.path.join(base, str(f))
        if str(f).startswith("..") or not os.path.isfile(src):
            continue  # scripts installed outside site-packages
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            import shutil; shutil.copy2(src, dst)
print(f"device packages linked from {sys.prefix}: {len(linked)} of {len(wanted)}")
EOF
# 2. a bare venv with .whl/ on top: pure wheels as they are, compiled ones as carried on
#    Python 3.12 (the device's), else fetched again for DEVICE_PY's version
pyver=$("$DEVICE_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
"$DEVICE_PY" -m venv --without-pip "$work/venv"
mkdir -p "$work/wheels"
compiled=()
for w in .whl/*.whl; do
  if [[ $w == *-none-any.whl || $pyver == 3.12 ]]; then
    cp "$w" "$work/wheels/"
  else
    b=$(basename "$w")
    compiled+=("${b%%-*}==$(cut -d- -f2 <<< "$b")")
  fi
done
if ((${#compiled[@]})); then
  download "$work/wheels" "$pyver" "${compiled[@]}"
  echo "cp${pyver/./} builds for the check: ${compiled[*]}"
else
  echo "the carried wheels themselves, on Python $pyver"
fi
"$DEVICE_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$work/site" "$work"/wheels/*.whl
export PYTHONPATH="$work/site:$work/base:$PWD" HF_HUB_OFFLINE=1
PY="$work/venv/bin/python"
# 3. every requirement of the repo and of each carried wheel is met, by a wheel or the device
"$PY" - "$work/site" <<'EOF'
import importlib.metadata as md, re, sys, tomllib
from packaging.requirements import Requirement
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
roots = [Requirement(r) for r in project["dependencies"]]
roots += [Requirement("together[tinker]==3.1.1"), Requirement("fastapi"), Requirement("uvicorn")]
roots += [Requirement(d.metadata["Name"]) for d in md.distributions(path=[sys.argv[1]])]
roots = [r for r in roots if not r.marker or r.marker.evaluate({"extra": ""})]
seen, missing, off = set(), [], []
todo = [(r, "pyproject / .whl") for r in roots]
while todo:
    req, by = todo.pop()
    key = (canon(req.name), tuple(sorted(req.extras)))
    if key in seen:
        continue
    seen.add(key)
    try:
        dist = md.distribution(req.name)
    except md.PackageNotFoundError:
        missing.append(f"{req} (needed by {by})")
        continue
    if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
        off.append(f"{req.name} {dist.version} vs {req} (by {by})")
    # the device's image is taken as consistent in itself: of a device package, follow only
    # what an extra asked for by the repo or a carried wheel adds (e.g. httpx[http2])
    on_device = not str(dist.locate_file("")).startswith(sys.argv[1])
    for r in dist.requires or []:
        rq = Requirement(r)
        base = not on_device and (not rq.marker or rq.marker.evaluate({"extra": ""}))
        if base or (rq.marker and any(rq.marker.evaluate({"extra": e}) for e in req.extras)):
            todo.append((rq, f"{dist.metadata['Name']} {dist.version}"))
for line in off:
    print("version outside a range here (the device's own may differ):", line)
if missing:
    sys.exit("missing: " + "; ".join(missing))
print(f"every requirement met: {len(seen)} distributions")
EOF
# 4. the server, the SDK and the CLI import; a small test and the gpu tests' collection run
"$PY" -c "import trainer.api.app, trainer.cli, together, tinker, fastapi, uvicorn, peft, pyrage, \
orjson, llguidance.hf; print('imports ok: together', together.__version__, 'fastapi', fastapi.__version__)"
"$PY" -m trainer --help > /dev/null
"$PY" -m pytest -q -p no:cacheprovider tests/test_imports.py tests/test_tiny.py
"$PY" -m pytest -q -p no:cacheprovider --collect-only tests/engine tests/perf tests/api | tail -1
# 5. the proof script itself, rehearsed in this environment (what the device will run)
mkdir -p "$work/out"
OUT="$work/out" PYTHON="$PY" bash scripts/gpu_proof.sh --rehearse > "$work/rehearsal.log" 2>&1 \
  || { tail -40 "$work/rehearsal.log" >&2; echo "the rehearsal failed here" >&2; exit 1; }
tail -1 "$work/rehearsal.log"
echo "device wheels: complete"
