"""Thin subclasses of TRL trainers: a config dataclass and a trainer per file."""
