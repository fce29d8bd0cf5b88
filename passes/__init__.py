"""Graph rewrites of zcompile: each pass is a function ``gm -> gm`` with a docstring.

Planning (returning plain data) is kept apart from rewriting; see ``README.md`` in this folder for
the invariants every pass keeps.
"""
