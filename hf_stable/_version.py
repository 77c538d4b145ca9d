"""The package version, in a module of its own so that code below the public API can stamp it on what it saves."""

__version__ = "0.1.0"
