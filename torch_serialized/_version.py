"""The package version: the single place it is written."""

__version__ = "0.2.0.dev0"
