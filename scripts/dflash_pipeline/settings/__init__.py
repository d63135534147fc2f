"""The config schema, shipped inside the package (`schema.yaml`): the one place that states a setting's type,
bounds and default. The workflow validates the config against it (and fills its defaults), every stage's
command-line options take their defaults from it (`cli.py`), and `typed.py` builds each stage's typed settings
object from it. Because it is package data, a stage run from an installed package sees the same defaults as one
run from a checkout.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path

SCHEMA_PATH = Path(__file__).resolve().with_name("schema.yaml")


@functools.cache
def schema() -> dict:
    import yaml  # only when a setting is asked for: `dflash-pipeline with-gpus` never pays for it

    return yaml.safe_load(SCHEMA_PATH.read_text())


def properties(section: str) -> dict:
    """{key: property schema} of a config section; nested sections are dotted (`generate.hf`)."""
    node = schema()
    for name in section.split("."):
        node = (node.get("properties") or {}).get(name) or {}
    return {k: v for k, v in (node.get("properties") or {}).items() if isinstance(v, dict)}


def prop(path: str) -> dict:
    """The property schema of one dotted key (`generate.max_new_tokens`)."""
    section, key = path.rsplit(".", 1)
    return properties(section)[key]


def defaults(section: str) -> dict:
    """{key: default} of a config section as the schema states them."""
    return {k: v["default"] for k, v in properties(section).items() if "default" in v}


def default(path: str):
    """The schema's default of one dotted key."""
    return prop(path)["default"]


def value(section: dict | None, path: str):
    """`section`'s value for the dotted key's last part, or the schema's default where it has none (a section
    the plan got in part, PLAN_KEYS, or a test's few keys): code never writes a default of its own."""
    got = (section or {}).get(path.rsplit(".", 1)[1])
    return default(path) if got is None else got


def field(path: str):
    """A dataclass field whose default is the schema's (a stage's own options object, built without the CLI); its
    metadata names the setting, so a test checks the field's type against the schema's."""
    return dataclasses.field(default_factory=lambda: copy.deepcopy(default(path)), metadata={"setting": path})


def options(cls, args, **extra):
    """An options dataclass from parsed CLI options: each field made with field() takes the option of its name
    (which the CLI defaults to the schema's), `extra` the rest."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if "setting" in f.metadata}, **extra)


def problem(value, property_schema: dict) -> str | None:
    """Why `value` breaks its property's schema (type, bounds, enum), or None."""
    from jsonschema import Draft202012Validator

    error = next(iter(Draft202012Validator(property_schema).iter_errors(value)), None)
    return None if error is None else error.message
