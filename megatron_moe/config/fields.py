"""Config fields that carry their own help text, and the CLI generated from them.

Each config group is a keyword-only dataclass whose fields are declared with
`arg(default, "help")`. `add_arguments` turns a group into an argparse group
(`field_name` -> `--field-name`), `from_namespace` builds the dataclass back,
so there is one source of truth for names, defaults and help.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Sequence


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag, value and a valid choice."""


def arg(default: Any, help: str, *, choices: Sequence[Any] | None = None, flag: str | None = None):
    """A dataclass field with CLI metadata. `default` may be a list (copied per instance)."""
    metadata = {"help": help, "choices": choices, "flag": flag}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _unwrap_optional(annotation):
    """`int | None` -> (int, True); `int` -> (int, False)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def add_arguments(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """Add one `--flag` per field of the dataclass `cls` to a new argument group."""
    group = parser.add_argument_group(title, (cls.__doc__ or "").strip().splitlines()[0])
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation, _ = _unwrap_optional(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        kwargs: dict[str, Any] = {"dest": field.name, "default": default}
        help_text = field.metadata.get("help", "")
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is list:
            kwargs["nargs"] = "+"
            kwargs["type"] = typing.get_args(annotation)[0]
        else:
            kwargs["type"] = annotation
        if field.metadata.get("choices"):
            kwargs["choices"] = field.metadata["choices"]
        group.add_argument(flag_name(field), help=f"{help_text} (default: {default})", **kwargs)


def from_namespace(cls: type, namespace: argparse.Namespace):
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def require(condition: bool, flag: str, value: Any, expected: str) -> None:
    """Raise ConfigError naming the flag, its value and what would be valid."""
    if not condition:
        raise ConfigError(f"{flag}={value}: {expected}")
