"""Experiment configs shipped with the package: `lalte-train --config NAME` or a file path."""
