#!/usr/bin/env bash
# The GPU check's environment, $GPU_VENV (default .venv-gpu), for `make gpu-check` (docs/benchmarks.md).
#
# 1. When $GPU_PYTHON (default python3) already has a CUDA build of torch, as on this workplace's H200
#    machines (python3 is /opt/torch/.venv/bin/python3 with torch 2.11.0+cu130), the venv reuses it: a
#    .pth file puts that python's site-packages after the venv's own, so the multi-GB CUDA stack is not
#    installed again. (--system-site-packages would not do: a venv made from a venv's python sees only
#    the base interpreter's packages.) Otherwise a plain venv gets $GPU_TORCH_SPEC (default
#    torch==2.13.0) from the package index: PyPI's Linux x86-64 torch wheels are the CUDA builds.
# 2. The project's requirements (pyproject.toml) and pytest, only those missing: from the wheelhouse
#    $GPU_WHEELS (default .whl/, filled by `make gpu-wheels`) without any index when it holds wheels,
#    else from the index, within $GPU_SETUP_TIMEOUT_S (default 180) seconds. A failure here is reported
#    and the check still runs: its model stages need only torch, transformers, numpy and safetensors.
# 3. The repository on the venv's path (a .pth file), and a report of what the venv has.
#
# Exit status 1 only when no torch can be imported at all.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_VENV:-.venv-gpu}
PY=${GPU_PYTHON:-python3}
TORCH_SPEC=${GPU_TORCH_SPEC:-torch==2.13.0}
WHEELS=${GPU_WHEELS:-.whl}
SETUP_TIMEOUT=${GPU_SETUP_TIMEOUT_S:-180}
say() { echo "[gpu-env] $*"; }

if ! command -v "$PY" >/dev/null 2>&1; then
    say "no $PY on this machine: set GPU_PYTHON to a Python ≥ 3.11"
    exit 1
fi

# "2.11.0+cu130 13.0", "2.13.0+cpu none", or nothing without torch.
base_torch=$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "none")' 2>/dev/null || true)
if [ ! -x "$VENV/bin/python" ]; then
    if [[ -n "$base_torch" && ( "$base_torch" != *" none" || -n "${GPU_REUSE_TORCH:-}" ) ]]; then
        say "reusing the torch of $PY ($base_torch) through a .pth overlay"
        "$PY" -m venv --without-pip "$VENV" || exit 1
        site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$PY" -c 'import os, sys; print("\n".join(p for p in sys.path
                  if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)))' \
            > "$site/_gpu_base_python.pth"
    else
        say "no CUDA torch in $PY (${base_torch:-no torch}): a fresh venv with $TORCH_SPEC from the package index"
        "$PY" -m venv "$VENV" || exit 1
        "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" || { say "could not install $TORCH_SPEC"; exit 1; }
    fi
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd > "$site/_dtp_layout_repo.pth"

PIP=("$VENV/bin/python" -m pip)
if ! "${PIP[@]}" --version >/dev/null 2>&1; then
    PIP=("$PY" -m pip --python "$VENV/bin/python")  # the venv borrows no pip: drive it from outside
fi
requirements="$VENV/dtp-requirements.txt"
"$VENV/bin/python" - > "$requirements" <<'PYEOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
print("\n".join([*project["dependencies"], *project["optional-dependencies"]["worker"], "pytest>=8"]))
PYEOF
stamp="$VENV/.gpu-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        source_args=(--no-index --find-links "$WHEELS")
        say "installing what is missing from the wheelhouse $WHEELS ($(ls "$WHEELS"/*.whl | wc -l) wheels, no index)"
    else
        source_args=(--timeout 10 --retries 1)
        say "installing what is missing from the package index (no wheelhouse at $WHEELS)"
    fi
    if timeout "$SETUP_TIMEOUT" "${PIP[@]}" install -q --disable-pip-version-check "${source_args[@]}" \
            -r "$requirements"; then
        touch "$stamp"
    else
        say "WARNING: not every requirement could be installed (offline without a wheelhouse? run"
        say "  make gpu-wheels where PyPI is reachable and carry .whl); the service tests may fail to import"
        if compgen -G "$WHEELS/*.whl" >/dev/null; then
            "${PIP[@]}" install -q --disable-pip-version-check --no-index --no-deps "$WHEELS"/*.whl || true
        fi
    fi
fi

"$VENV/bin/python" - <<'PYEOF' || exit 1
import importlib.util
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
print(f"[gpu-env] {torch.__file__}: torch {torch.__version__} (CUDA {torch.version.cuda}); GPU: {gpu}")
needed = ("transformers", "safetensors", "numpy", "pytest", "fastapi", "sqlalchemy", "alembic", "celery",
          "kombu", "pydantic_settings", "gguf", "models", "app", "worker")
missing = [name for name in needed if importlib.util.find_spec(name) is None]
print(f"[gpu-env] missing: {', '.join(missing) or 'nothing'}")
PYEOF
