"""Command-line flags declared on a dataclass's fields, and the argparse parser built from them.

`vaed serve`'s flags were written twice (the config's fields, then a hand-kept
argparse list), and their defaults a third time in the README. Here a field
says how it is spelled on the command line (`metadata={"flag": Flag(...)}`, or
the `option()` shorthand) and `add_arguments` builds the parser from the fields,
so a flag's name, default and choices come from the field they set. A field
without a Flag is no flag (set by other means, or only by code and tests).

A plain dataclass and argparse are enough for ~40 flags of scalars; a CLI
library (typer, click) would bring a second parser model for no flag that
argparse cannot express.

This module imports nothing from vaed but `vaed.choices`, so the config can
declare its flags without pulling in torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .choices import Choice


@dataclass(frozen=True)
class Flag:
    """How one dataclass field is set from the command line."""

    help: str
    name: str | None = None  # None: "--" + the field name with dashes
    parse: Callable[[str], Any] | None = None  # argparse `type`; None keeps the text
    choices: type[Choice] | None = None  # the accepted strings are its values
    # The accepted strings of a flag that is no Choice, from a function because computing them
    # needs a heavy import (the op names need torch).
    choice_names: Callable[[], Sequence[str]] | None = None
    metavar: str | None = None
    default_note: str = ""  # said after the default: "(default 399360 = 480x832)"
    no_default: str | None = None  # what a None default means, in words: "(default: off)"
    # "store_false" (a --no-X flag for a True field), "store_true" (a --X flag for a False
    # field), "append" (a tuple field)
    action: str | None = None
    # Other names of the flag, e.g. a former one kept so deployments that pass it still start.
    aliases: tuple[str, ...] = ()

    def flag_name(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")

    def choice_values(self) -> list[str] | None:
        if self.choices is not None:
            return list(self.choices.values())
        if self.choice_names is not None:
            return list(self.choice_names())
        return None


def option(default: Any, help: str, **flag: Any) -> Any:
    """A dataclass field that is also a flag: `port: int = option(50051, "port to bind")`."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **flag)})


def flag_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of dataclass `cls` that are flags, in declaration order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _help(flag: Flag, default: Any) -> str:
    if flag.action == "store_false" or default in ((), False):
        return flag.help
    if default is None:
        return f"{flag.help} (default: {flag.no_default})" if flag.no_default else flag.help
    note = f" {flag.default_note}" if flag.default_note else ""
    return f"{flag.help} (default %(default)s{note})"


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One argparse option per flag field of `cls`; each stores into `args.<field name>`."""
    for field, flag in flag_fields(cls):
        default = field.default
        name = flag.flag_name(field.name)
        help_text = _help(flag, default)
        if flag.action in ("store_false", "store_true"):
            parser.add_argument(name, *flag.aliases, dest=field.name, action=flag.action, help=help_text)
            continue
        kwargs: dict[str, Any] = {"dest": field.name, "help": help_text}
        if flag.parse is not None:
            kwargs["type"] = flag.parse
        if flag.metavar is not None:
            kwargs["metavar"] = flag.metavar
        choices = flag.choice_values()
        if choices is not None:
            kwargs["choices"] = choices
        if flag.action == "append":
            kwargs.update(action="append", default=[])
        else:
            # A Choice default is shown and compared as its string ("auto"); the config turns
            # the parsed string back into the member.
            kwargs["default"] = default
        parser.add_argument(name, *flag.aliases, **kwargs)


def values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """`cls`'s flag fields as parsed into `args` (appended lists as tuples), for `cls(**values)`."""
    out: dict[str, Any] = {}
    for field, flag in flag_fields(cls):
        value = getattr(args, field.name)
        out[field.name] = tuple(value) if flag.action == "append" else value
    return out


def coerce_choices(obj: Any) -> None:
    """In a frozen dataclass's __post_init__: turn each choice field's string into its enum
    member (callers and tests may pass "off"), with a ValueError naming the field otherwise."""
    for field, flag in flag_fields(type(obj)):
        enum = flag.choices
        value = getattr(obj, field.name)
        if enum is not None and value is not None and not isinstance(value, enum):
            object.__setattr__(obj, field.name, enum.parse(value, field.name))


# -- flag text parsers (argparse `type`s) --------------------------------------------------


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1; got {text!r}")
    return int(text)


def whole_number(text: str) -> int:
    """A count or a limit where 0 means none (no limit, no batch): 0 or more."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0; got {text!r}")
    return int(text)


def port_number(text: str) -> int:
    """A TCP port, 0 (the system picks a free one) to 65535: a larger one wrapped around in the
    bind (70000 bound 4464) and a negative one bound 65535."""
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535 (0 picks a free one); got {text!r}")
    return int(text)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0; got {text!r}")
    return value


def shapes(text: str) -> tuple[tuple[int, int], ...]:
    """--warmup-shapes 480x832,720x1280 | none -> ((480, 832), (720, 1280))."""
    if text.strip().lower() == "none":
        return ()
    out = []
    for part in text.split(","):
        h, sep, w = part.strip().lower().partition("x")
        if not sep or not h.isdigit() or not w.isdigit() or int(h) < 1 or int(w) < 1:
            raise argparse.ArgumentTypeError(f"warm-up shapes look like 480x832,720x1280 (H x W) or none; got {part!r}")
        out.append((int(h), int(w)))
    return tuple(out)
