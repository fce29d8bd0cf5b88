"""Pieces every subsystem uses: the data-parallel process group, node topology, the dump directory,
communication volumes, and the one module that reads Dynamo internals."""
