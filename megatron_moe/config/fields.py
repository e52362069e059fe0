"""Config fields that carry their own help text, and the CLI generated from them.

Each config group is a keyword-only dataclass whose fields are declared with
`arg(default, "help")`. `add_arguments` turns a group into an argparse group
(`field_name` -> `--field-name`), `from_namespace` builds the dataclass back,
so there is one source of truth for names, defaults and help.

A field may also say when it does anything (`applies=When(test, "with --fp16")`):
a flag the user gives where it would change nothing is accepted with one line
saying so (`flags_that_change_nothing`), never silently ignored; a tool without
a start-up log refuses it instead (`check_given_flags_apply`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag, value and a valid choice."""


class ConfigErrors(ConfigError):
    """Several configuration errors found in one pass, reported together: one line each under a count."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        lines = "\n".join(f"  {error}" for error in self.errors)
        super().__init__(f"{len(self.errors)} configuration errors:\n{lines}")


def raise_errors(errors: Sequence[str]) -> None:
    """Nothing for no error; the one error as a plain one-line ConfigError; several as one ConfigErrors."""
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigErrors(errors)


def error_lines(error: ConfigError) -> list[str]:
    """The one-line errors a ConfigError (or ConfigErrors) holds."""
    return list(error.errors) if isinstance(error, ConfigErrors) else [str(error)]


class Collector:
    """Runs independent checks and keeps every ConfigError they raise, so that one pass reports them all.

    errors = Collector()
    with errors:
        check_a()
    with errors:
        check_b()
    errors.raise_all()
    """

    def __init__(self):
        self.errors: list[str] = []

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, ConfigError):
            self.errors += [line for line in error_lines(error) if line not in self.errors]
            return True
        return False

    def add(self, error: str) -> None:
        """One more error line (found without a check that raises)."""
        if error not in self.errors:
            self.errors.append(error)

    def raise_all(self) -> None:
        raise_errors(self.errors)


@dataclasses.dataclass(frozen=True)
class When:
    """The condition under which a flag changes what runs: a test of the whole run config, and its words."""

    test: Callable[[Any], bool]
    """Takes the RunConfig; True when the flag is read."""
    text: str
    """E.g. "with --fp16"; completes "applies only ..."."""


def arg(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | None = None,
    flag: str | None = None,
    applies: When | None = None,
    parse: Callable[[Any], Any] | None = None,
    flag_default: Any = dataclasses.MISSING,
):
    """A dataclass field with CLI metadata. `default` may be a list (copied per instance);
    `applies`: when the flag does anything (given otherwise, it is refused); `parse`: text -> the typed value
    (idempotent on typed values; text it cannot read is left as given, for the checks to name); `flag_default`:
    the run flag's default where it differs from the field's (`flag_fields`)."""
    metadata = {"help": help, "choices": choices, "flag": flag, "applies": applies, "parse": parse}
    if flag_default is not dataclasses.MISSING:
        metadata["flag_default"] = flag_default
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def is_flag(field: dataclasses.Field) -> bool:
    """Whether the field declares a CLI flag (`arg`), not only the flag that sets it elsewhere."""
    return "help" in field.metadata


def flag_attribute(field: dataclasses.Field) -> str:
    """The run config's attribute for the flag a field declares: `--moe-router-topk` -> `moe_router_topk`."""
    return flag_name(field)[2:].replace("-", "_")


def flag_fields(cls: type) -> list[tuple[str, Any, dataclasses.Field]]:
    """`dataclasses.make_dataclass` fields for the flags that the dataclass `cls` declares (`arg(..., flag=)`):
    named by the flag, with the field's metadata and its `flag_default` (an unset-able flag, default None, is
    optional). One declaration serves both: the settings' own config, and the run's flag group."""
    hints = typing.get_type_hints(cls)
    fields = []
    for field in dataclasses.fields(cls):
        if not is_flag(field):
            continue
        default = field.metadata.get("flag_default", field.default)
        kind = hints[field.name] if default is not None else hints[field.name] | None
        fields.append((flag_attribute(field), kind, dataclasses.field(default=default, metadata=field.metadata)))
    return fields


def parse_flag_values(group: Any) -> None:
    """Every field of `group` with a `parse` hook holds its typed value, whoever built the group (argparse already
    parsed what a user typed; a caller may pass text)."""
    for field in dataclasses.fields(group):
        parse = field.metadata.get("parse")
        if parse is not None:
            setattr(group, field.name, parse(getattr(group, field.name)))


def _unwrap_optional(annotation):
    """`int | None` -> (int, True); `int` -> (int, False)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str,
    *,
    defaults: bool = True,
    only: Iterable[str] | None = None,
    description: str | None = None,
) -> None:
    """Add one `--flag` per field of the dataclass `cls` to a new argument group.

    `defaults=False`: a flag not given is left out of the namespace (to see what the user typed);
    `only`: these fields' flags alone (a tool that shares some of a group's flags, e.g. the tokenizer's), under
    `description` (default: the first line of the class's docstring)."""
    group = parser.add_argument_group(title, description or (cls.__doc__ or "").strip().splitlines()[0])
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if only is not None and field.name not in only:
            continue
        annotation, _ = _unwrap_optional(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        kwargs: dict[str, Any] = {"dest": field.name, "default": default if defaults else argparse.SUPPRESS}
        help_text = field.metadata.get("help", "")
        if field.metadata.get("parse"):
            kwargs["type"] = field.metadata["parse"]
        elif annotation is bool and field.name.startswith("no_"):
            # A plain switch: BooleanOptionalAction reads the leading --no- as the negation, so
            # --no-load-optim would set no_load_optim=False, a silent no-op.
            kwargs["action"] = "store_true"
        elif annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is list:
            kwargs["nargs"] = "+"
            kwargs["type"] = typing.get_args(annotation)[0]
        else:
            kwargs["type"] = annotation
        if field.metadata.get("choices"):
            kwargs["choices"] = field.metadata["choices"]
        applies = field.metadata.get("applies")
        group.add_argument(flag_name(field), help=help_with_default(help_text, default, applies), **kwargs)


def help_with_default(help_text: str, default: Any, applies: When | None) -> str:
    """`help (default: X; only ...)`: the default left out where the help already says what unset means (an
    unset optional flag's default, None, says nothing)."""
    said = default is None or "default" in help_text or "unset" in help_text
    notes = ([] if said else [f"default: {default}"]) + ([f"only {applies.text}"] if applies else [])
    return f"{help_text} ({'; '.join(notes)})" if notes else help_text


def from_namespace(cls: type, namespace: argparse.Namespace):
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def _given_that_change_nothing(run_config: Any, groups: Iterable[tuple[str, type]], given: set[str]):
    """(group name, field, its value, its When) of each flag the user gave whose condition this run does not
    meet."""
    for name, cls in groups:
        for field in dataclasses.fields(cls):
            applies = field.metadata.get("applies")
            if field.name in given and applies is not None and not applies.test(run_config):
                yield name, field, getattr(getattr(run_config, name), field.name), applies


def flags_that_change_nothing(run_config: Any, groups: Iterable[tuple[str, type]], given: set[str]) -> list[str]:
    """One line per flag the user gave that changes nothing in this run, saying when it would (the start-up log
    prints them), each such field set back to its default in `run_config`: accepted, as Megatron-LM accepts them
    (e.g. --sequence-parallel at TP=1, which it turns off; --moe-grouped-gemm with our MoE layer), and the run is
    then exactly the one without the flag, whatever code reads the field. Set back until none is left (a field
    set back may leave another given flag with nothing to do)."""
    notes, set_back = [], set()
    while pending := list(_given_that_change_nothing(run_config, groups, given - set_back)):
        for name, field, value, applies in pending:
            notes.append(
                f"{as_typed(flag_name(field), value)}: changes nothing in this run (it applies only {applies.text}); "
                "accepted and ignored"
            )
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            setattr(getattr(run_config, name), field.name, default)
            set_back.add(field.name)
    return notes


def as_typed(flag: str, value: Any) -> str:
    """The flag as typed: `--x` for a switch, `--no-x` for its negation, else `--x VALUE`."""
    if value is True:
        return flag
    if value is False:
        return "--no-" + flag[2:]
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def check_given_flags_apply(run_config: Any, groups: Iterable[tuple[str, type]], given: set[str]) -> None:
    """Refuse a flag the user gave that does nothing in this run: for tools that have no start-up log to say
    so in (the trainer accepts it with a line, `flags_that_change_nothing`)."""
    for _, field, value, applies in _given_that_change_nothing(run_config, groups, given):
        raise ConfigError(
            f"{flag_name(field)}={value}: does nothing in this run; it applies only "
            f"{applies.text} (drop it, or set what it needs)"
        )


def require(condition: bool, flag: str, value: Any, expected: str) -> None:
    """Raise ConfigError naming the flag, its value and what would be valid."""
    if not condition:
        raise ConfigError(f"{flag}={value}: {expected}")


def require_finite_floats(group: Any) -> None:
    """Every float field of the config group `group` (and each float of a list field) is a number: argparse's
    `float` takes "nan" and "inf", which would pass `> 0` and `< x` range checks (NaN fails every comparison,
    inf passes the lower bounds) and fail later with a raw error. No flag here gives NaN or inf a meaning."""
    hints = typing.get_type_hints(type(group))
    for field in dataclasses.fields(group):
        kind, _ = _unwrap_optional(hints[field.name])
        if kind is not float and kind != list[float]:
            continue
        value = getattr(group, field.name)
        values = value if isinstance(value, list) else [value]
        bad = next((v for v in values if isinstance(v, float) and not math.isfinite(v)), None)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        example = default if default is not None and not isinstance(default, list) else 1.0
        shown = " ".join(map(str, values))
        require(bad is None, flag_name(field), shown, f"must be a finite number, e.g. {flag_name(field)} {example}")


def require_positive(flag: str, value: Any, example: Any = 1) -> None:
    """`value` > 0 (None, an unset optional flag, passes)."""
    require(value is None or value > 0, flag, value, f"must be > 0, e.g. {flag} {example}")


def require_non_negative(flag: str, value: Any, example: Any = 0) -> None:
    """`value` >= 0 (None, an unset optional flag, passes)."""
    require(value is None or value >= 0, flag, value, f"must be >= 0, e.g. {flag} {example}")


def require_fraction(flag: str, value: float, example: float, *, below_one: bool = False) -> None:
    """`value` in [0, 1], or [0, 1) with `below_one`."""
    fits = 0 <= value < 1 if below_one else 0 <= value <= 1
    require(fits, flag, value, f"must be in [0, 1{')' if below_one else ']'}, e.g. {flag} {example}")
