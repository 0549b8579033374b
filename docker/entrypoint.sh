#!/usr/bin/env bash
# Entrypoint of the hvd_topk image: runs the given command (default: horovodrun --check-build) in the
# image's environment. pyxis/enroot and Apptainer skip it; everything that matters is also set by the
# Dockerfile's ENV lines, this only adds what a plain `docker run` needs.
set -euo pipefail

# Containers run as root; Open MPI's mpirun refuses that unless told it is deliberate.
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}

if [ "$#" -eq 0 ]; then
    set -- horovodrun --check-build
fi
exec "$@"
