"""Typed settings: one frozen dataclass per stage, generated from the schema.

A stage's settings are the options that are config keys (`cli.setting_keys`: the keys of its sections plus its
aliases). `for_stage(stage, args)` turns the parsed options (schema defaults, then `--settings`, then explicit
options, all checked against the schema) into an instance of that stage's class, so the code behind a stage reads
`settings.num_anchors` from a typed, immutable object, never from a raw `argparse.Namespace`. The classes are
generated rather than written out so that a field, its type and its default cannot drift from the schema
(docs/architecture.md, "Settings").
"""

from __future__ import annotations

import dataclasses
import functools
import typing

from dflash_pipeline import settings

_JSON_TYPES = {"integer": int, "number": float, "boolean": bool, "string": str, "array": tuple, "object": dict,
               "null": type(None)}


def python_type(prop: dict):
    """The Python type of a property schema (`oneOf` and `type: [.., null]` become unions)."""
    if "enum" in prop:
        kinds = {type(v) for v in prop["enum"]}
        return kinds.pop() if len(kinds) == 1 else typing.Union[tuple(sorted(kinds, key=str))]
    if "oneOf" in prop:
        return functools.reduce(lambda a, b: a | b, (python_type(p) for p in prop["oneOf"]))
    kinds = prop.get("type", "object")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if kinds == ["number"]:
        return float | int  # YAML writes 6 for 6.0
    return functools.reduce(lambda a, b: a | b, (_JSON_TYPES[k] for k in kinds))


def _frozen(value):
    """Lists become tuples: a settings object is immutable all the way down."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


@functools.cache
def stage_class(stage: str, dests: frozenset[str]) -> type:
    """The frozen dataclass of a stage's settings (`dests`: its options, as the parser has them)."""
    from dflash_pipeline import cli

    keys = cli.setting_keys(stage, dests)
    fields = [(dest, python_type(settings.prop(path))) for dest, path in sorted(keys.items())]
    name = "".join(part.capitalize() for part in stage.replace("-", "_").split("_")) + "Settings"
    return dataclasses.make_dataclass(name, fields, frozen=True, namespace={"__module__": __name__})


def for_stage(stage: str, args) -> typing.Any:
    """The stage's typed settings from its parsed options."""
    cls = stage_class(stage, frozenset(vars(args)))
    return cls(**{f.name: _frozen(getattr(args, f.name)) for f in dataclasses.fields(cls)})
