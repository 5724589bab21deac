"""CLI: ``python -m lightning_shard.checkpoint.consolidate IN OUT [--safetensors] [--overwrite] [--require-marker]``.

Streams the sharded checkpoint directory ``IN`` into one file ``OUT`` that ``torch.load(OUT, weights_only=True)``
reads (or, with ``--safetensors``, the model weights as a safetensors file). An existing ``OUT`` is refused
unless ``--overwrite``; every entry is verified against its checksum; errors exit 1 with one line naming the
file. The implementation and the Python API, :func:`lightning_shard.checkpoint.consolidate`, live in
``_consolidate.py`` (the package does not import this module, so ``python -m`` runs it once).

Example::

    python -m lightning_shard.checkpoint.consolidate ckpts/step3 step3.pt
"""

import sys

from lightning_shard.checkpoint._consolidate import consolidate, main

__all__ = ["consolidate", "main"]

if __name__ == "__main__":
    sys.exit(main())
