"""The core: per-rank state and pure tensor functions that every layer above uses (residuals, exact top-k,
sizes on the wire, argument checks). Imports nothing above it, and no Horovod."""
