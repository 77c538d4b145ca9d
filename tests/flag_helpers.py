"""Shared parts of the flag-effect matrices (tests/trainers/test_{grpo,sft}_flags.py): the fields a config adds to
its TRL parent, the reader of a field, the coverage check and the changed-or-refused assertion."""

import dataclasses

import torch


def added_fields(config_cls, parent_cls) -> list[str]:
    """The fields of ``config_cls`` that ``parent_cls`` does not define, sorted."""
    ours = {f.name for f in dataclasses.fields(config_cls)}
    return sorted(ours - {f.name for f in dataclasses.fields(parent_cls)})


def reader_activation(registries, field: str) -> dict:
    """The config values that make the first method reading ``field`` active; ``{}`` for a selector (its base is the
    default, the alternative turns a method on)."""
    for registry in registries:
        if field == registry.selector:
            return {}
        readers = registry.readers(field)
        if readers:
            return registry.activation(readers[0].name)
    raise AssertionError(f"no registered method reads {field!r}")


def assert_covered(fields, alternatives: dict, allowlist: dict[str, str], what: str) -> None:
    uncovered = [f for f in fields if f not in alternatives and f not in allowlist]
    assert not uncovered, f"{what} fields without a flag-effect case: {uncovered}"
    assert not (set(alternatives) | set(allowlist)) - set(fields), "stale entries"
    assert all(reason for reason in allowlist.values())


def assert_changes_or_refused(run, field: str, base: dict, value, default) -> None:
    """``run(name, config)`` returns a parameter update; changing ``field`` to ``value`` must change it, or raise a
    ValueError naming the field."""
    assert base.get(field, default) != value, "the alternative is the base value"
    reference = run("base", base)
    try:
        changed = run("changed", {**base, field: value})
    except ValueError as error:
        assert f"`{field}`" in str(error) or f"{field}=" in str(error), str(error)
        return
    assert torch.isfinite(changed).all() and torch.isfinite(reference).all()
    assert not torch.equal(changed, reference), f"{field}={value!r} left the update unchanged"
