"""Helpers shared by the tests: models, graph builders, launchers. Test files import from here, never from each other."""
