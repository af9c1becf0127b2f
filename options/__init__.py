"""Build argparse options from a config dataclass, so each command has one source of truth.

A field declares its flag help with ``opt(default, "help text")``; ``add_options`` turns the
fields into ``--kebab-case`` flags and ``from_args`` builds the dataclass back from the parsed
namespace. Defaults shown by ``--help`` are the dataclass defaults.

``opt`` is the one settings helper: the stages' own configs (``trainer.config.TrainSettings``,
``span_to_transition.convert.ConvertConfig``, ``rollout.driver.RolloutConfig``) declare their fields
with it too. It is the ground floor (DESIGN.md's package table): it imports only the standard
library and nothing of ours, so every stage and the CLI import it and no arrow runs up into
``tracerl/``. ``UsageError`` lives here for the same reason: a stage raises it for bad user input
and the CLI turns it into exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class UsageError(Exception):
    """Bad input from the user: the CLI exits 2 and prints the message, which names the fix."""


def opt(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: list[str] | None = None,
    env: str | None = None,
) -> Any:
    """A dataclass field with its CLI help; ``env`` names an environment variable default."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "choices": choices, "env": env}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def add_options(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        meta = f.metadata
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = meta["help"]
        if meta.get("env"):
            help_text += f" [env {meta['env']}]"
        if tp is bool:
            parser.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        # a help text that says its own default (or "unset: ...") is not followed by a second one
        says_default = default is None or "default:" in help_text or "unset:" in help_text
        kw: dict[str, Any] = {
            "dest": f.name,
            "default": default,
            "help": help_text + ("" if says_default else " (default: %(default)s)"),
        }
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        if meta.get("choices"):
            kw["choices"] = meta["choices"]
        if typing.get_origin(tp) is list:
            kw["nargs"] = "*"
            kw["type"] = typing.get_args(tp)[0]
        elif tp in (int, float, str):
            kw["type"] = tp
        parser.add_argument(flag, **kw)


def from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
        env = f.metadata.get("env")
        default = f.default if f.default is not dataclasses.MISSING else None
        if env and values.get(f.name, default) == default and os.environ.get(env):
            values[f.name] = os.environ[env]
    values.update(overrides)
    return cls(**values)


def from_fields(cls: type[T], source: Any, **overrides: Any) -> T:
    """``cls`` built from the same-named fields of another settings object, plus ``overrides``.

    A command's config holds the flags; the stage it runs takes its own settings dataclass. Building
    one from the other by name (``from_fields(Driver, cfg, tasks=parsed_tasks)``) keeps a new flag from
    being dropped by a hand-written copy; ``overrides`` give the fields whose value the command turns
    into another form (a parsed ``--store``, the loaded tasks) or that are named differently.
    """
    values = {
        f.name: getattr(source, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init and hasattr(source, f.name)
    }
    values.update(overrides)
    return cls(**values)
