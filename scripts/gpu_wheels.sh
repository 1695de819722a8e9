#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels tests/gpu/run.sh installs on the GPU machine, where nothing can be
# fetched. That machine's python3 is Python 3.12 with torch 2.11, transformers 5.17 and the rest of its image
# (the versions are in docs/gpu.md); this script downloads, for cp312 on manylinux x86-64 and without their
# dependencies, the pinned wheels of:
#   MISSING   what the image lacks: rlctl's config and registry stack (pydantic, SQLAlchemy, Alembic) and the
#             bench extra's TRL with datasets (the TRL step-time comparison);
#   FALLBACK  what the image has at a version nobody here has read (typer, rich, pluggy ...): run.sh installs
#             one of these only where the image's version is outside rlctl's range (tests/gpu/prepare.py).
# Not here: ray (its wheel is 76 MiB, over what travels with the working tree: the one Ray-actor GPU test skips
# there), torch and the Hugging Face stack (the image's own are used).
# The versions are those a fresh `pip install -e '.[dev,bench]'` resolves here; tests/unit/test_gpu_prepare.py
# checks that each still satisfies pyproject.toml. The total must stay under 40 MiB (the tree travels in 64).
#   bash scripts/gpu_wheels.sh            then: bash tests/gpu/run.sh on the GPU machine, with .whl carried
# Not for: a developer's venv (README's pip install), or any Python other than 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEST=${DEST:-.whl}
MAX_MIB=40

MISSING=(sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3
         pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
         trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
FALLBACK=(typer==0.29.2 rich==15.0.0 pluggy==1.7.0 typing-extensions==4.16.0 annotated-doc==0.0.7)

# pip matches each manylinux tag exactly (no older glibc implied), so name every one a wheel may carry;
# the image's torch is a manylinux_2_28 build, so its glibc runs all of these.
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --dest "$DEST" "${MISSING[@]}" "${FALLBACK[@]}" 2> >(grep -v "is ignored" >&2)

count=$(find "$DEST" -type f -name '*.whl' | wc -l)
bytes=$(du -cb "$DEST"/*.whl | tail -n1 | cut -f1)
want=$(( ${#MISSING[@]} + ${#FALLBACK[@]} ))
echo "$DEST: $count wheels, $(( bytes / 1024 )) KiB"
if (( count != want )); then
    echo "gpu_wheels.sh: expected $want wheels, got $count" >&2
    exit 1
fi
if (( bytes > MAX_MIB * 1024 * 1024 )); then
    echo "gpu_wheels.sh: $DEST is over $MAX_MIB MiB; drop a wheel or let the image's version do" >&2
    exit 1
fi
