"""The `hf-stable` command line."""
