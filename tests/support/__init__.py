"""Helpers shared by the test modules: fake executor, servers, references, tiny checkpoints."""
