"""Command-line flags declared once, on the fields of a config dataclass.

A config type is the one place its settings are written: each field that is also a flag carries its
flag in the field's metadata (``flag(...)``). From that one declaration come the parser's arguments
(``add_flags``), the config built from parsed arguments (``config_from_args``) and the command line a
launcher hands a child process so that it builds the same config (``argv_from_args``). Adding a
setting is one field; nothing else lists the flags.

Torch-free: the parser of ``pdserve up --device cpu`` is built without importing torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Collection
from typing import Any

_KEY = "pdserve_flag"
_ABSENT = object()  # a Flag without its own cli_default


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line.

    ``parse`` is argparse's type for the flag's text; ``to_field`` turns the parsed value into the
    field's value (identity when None). A bool field is a switch: ``--name`` sets it True, or with
    ``negated`` a ``--no-...`` name sets it False. ``cli_default`` is the parsed value when the flag is
    absent (default: the field's default), for flags whose absence means something (``None``); ``env``
    names a variable that supplies it instead when set (read when the parser is built; for a switch,
    ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` is the field's value).
    """

    help: str
    name: str | None = None
    parse: Callable[[str], Any] | None = None
    to_field: Callable[[Any], Any] | None = None
    choices: tuple[str, ...] | None = None
    negated: bool = False
    cli_default: Any = _ABSENT
    metavar: str | None = None
    env: str | None = None  # an environment variable whose value, when set and not empty, is the default
    action: str | None = None  # argparse's action for a repeatable flag ("extend")
    secret: bool = False  # a token or key: kept out of the config's repr, and out of a child's command line


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a bad value is a usage error before any worker starts."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0 (where 0 turns something off), else a usage error."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (an interval), else a usage error before any process starts."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def flag(default: Any = dataclasses.MISSING, help: str = "", *, default_factory: Callable[[], Any] | None = None,
         secret: bool = False, **options: Any) -> Any:
    """A dataclass field that is also a command-line flag (``options``: the fields of :class:`Flag`);
    a ``secret`` one (a token, a key) stays out of the config's repr."""
    metadata = {_KEY: Flag(help=help, secret=secret, **options)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata, repr=not secret)
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


def _flags(config_type: type) -> list[tuple[dataclasses.Field, Flag, str]]:
    """(field, its flag, the flag's name) for every field of ``config_type`` that is a flag."""
    out = []
    for f in dataclasses.fields(config_type):
        spec = f.metadata.get(_KEY)
        if spec is not None:
            out.append((f, spec, spec.name or "--" + f.name.replace("_", "-")))
    return out


def declared_flags(config_type: type) -> dict[str, Flag]:
    """Every flag of ``config_type`` by name, in declaration order: for a launcher that decides which of its
    children takes which flag (``pdserve up``) from the declarations instead of a list of its own."""
    return {name: spec for _f, spec, name in _flags(config_type)}


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


_SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                 "off": False}


def _env_switch(parser: argparse.ArgumentParser, spec: Flag) -> bool | None:
    """A switch's field value from its environment variable; None when unset or empty."""
    text = os.environ.get(spec.env or "", "").strip()
    if not text:
        return None
    if text.lower() not in _SWITCH_WORDS:
        parser.error(f"${spec.env} must be one of {', '.join(_SWITCH_WORDS)}; got {text!r}")
    return _SWITCH_WORDS[text.lower()]


def add_flags(parser: argparse.ArgumentParser, config_type: type, only: Collection[str] | None = None) -> None:
    """Add one argument per flagged field of ``config_type`` (with ``only``: those of the flags it names)."""
    for f, spec, name in _flags(config_type):
        if only is not None and name not in only:
            continue
        default = _field_default(f)
        if isinstance(default, bool):
            from_env = _env_switch(parser, spec)
            # The parsed value says "the switch was given"; a negated switch gives False.
            given = {} if from_env is None else {"default": from_env != spec.negated}
            parser.add_argument(name, action="store_true", help=spec.help, **given)
            continue
        cli_default = default if spec.cli_default is _ABSENT else spec.cli_default
        if spec.env is not None and os.environ.get(spec.env):
            cli_default = os.environ[spec.env]
        extra = {"action": spec.action} if spec.action is not None else {}
        parser.add_argument(name, type=spec.parse, default=cli_default, choices=spec.choices, help=spec.help,
                            metavar=spec.metavar, **extra)


def add_forwarded_flags(parser: argparse.ArgumentParser, config_type: type, names: Collection[str]) -> None:
    """The flags of ``config_type`` named in ``names``, for a launcher that hands them to a child which parses
    them itself: each value is checked as the child checks it (a bad one is a usage error before anything
    starts) and kept as typed; a flag not given is absent from the namespace, so the child applies its own
    default and environment variable (which it inherits). A switch given is True; a repeatable flag, a list."""
    for f, spec, name in _flags(config_type):
        if name not in names:
            continue
        if isinstance(_field_default(f), bool):
            parser.add_argument(name, action="store_true", default=argparse.SUPPRESS, help=spec.help)
            continue
        parser.add_argument(name, type=_checked_text(spec.parse), default=argparse.SUPPRESS, choices=spec.choices,
                            help=spec.help, metavar=spec.metavar, action="append" if spec.action else None)


def _checked_text(parse: Callable[[str], Any] | None) -> Callable[[str], str]:
    """An argparse type that refuses what ``parse`` refuses and returns the text itself (what the child gets)."""
    if parse is None:
        return str

    def check(text: str) -> str:
        parse(text)
        return text

    check.__name__ = getattr(parse, "__name__", "value")  # argparse's "invalid <name> value" message
    return check


def config_from_args(config_type: type, args: argparse.Namespace, **fields: Any) -> Any:
    """The config the parsed flags describe; ``fields`` sets fields that are not flags (or overrides)."""
    values = {}
    for f, spec, name in _flags(config_type):
        given = getattr(args, _dest(name))
        if isinstance(_field_default(f), bool):
            values[f.name] = not given if spec.negated else given
        else:
            values[f.name] = spec.to_field(given) if spec.to_field is not None else given
    return config_type(**{**values, **fields})


def argv_from_args(config_type: type, args: argparse.Namespace) -> list[str]:
    """The flags of ``config_type`` in ``args`` as a command line a child process parses back to the
    same config: every valued flag that is set, every switch that is on."""
    argv: list[str] = []
    for f, _spec, name in _flags(config_type):
        given = getattr(args, _dest(name))
        if isinstance(_field_default(f), bool):
            argv += [name] if given else []
        elif given is not None:
            argv += [name, str(given)]
    return argv
