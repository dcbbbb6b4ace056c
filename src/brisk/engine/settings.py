"""Engine settings, generated from the config dataclasses' `setting(...)` fields (engine/config.py).

One table (`SETTINGS`, keyword -> where it lives) gives:
  * the keywords of `LLM(...)`, their defaults and documentation (`llm_signature`, `settings_doc`);
  * the kwargs -> EngineConfig construction (`build_engine_config`), the one place that knows which keyword
    fills which subsystem's dataclass;
  * the click options of every command that builds an engine (`engine_options`, `setting_option`), and the
    command line that hands the same settings to a `brisk serve` child process (`cli_args`).

A keyword's CLI flag is `--keyword-with-dashes` unless the field names another (`num_threads` -> `--threads`); a
boolean is the pair `--flag/--no-flag` (`enable_prefix_caching` -> `--prefix-caching/--no-prefix-caching`).
A click parameter is named after the LLM keyword, so `kw["enable_prefix_caching"]` goes to LLM unchanged. A
field's `aliases` are other spellings of the same option (vLLM's `--enable-prefix-caching`, `-tp`), so every
command that takes the setting takes them; its `section` is the group its option is listed under in the help of
a `SectionedCommand` (generate, chat, serve).
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from functools import cache
from typing import Any

import click

from brisk.engine.config import SETTING, CacheConfig, EngineConfig, SchedulerConfig, Setting

# The dataclasses whose settings are LLM keywords, in the order the keywords are listed.
_OWNERS: tuple[type, ...] = (EngineConfig, SchedulerConfig, CacheConfig)
_UNSET: Any = object()
# The groups of a command's help, in the order they are listed (a setting's `section`, an option's
# SectionOption.section); "other" gathers options that name none, and --help.
SECTIONS: dict[str, str] = {
    "model": "Model", "generation": "Generation", "kv cache": "KV cache", "speculative": "Speculative decoding",
    "performance": "Performance", "parallel": "Parallel", "server": "Server", "other": "Other",
}


@dataclass(frozen=True)
class EngineSetting:
    """One user-facing setting: the LLM keyword, the dataclass field it fills, its type, default and metadata."""

    kwarg: str
    owner: type
    field: str
    type: Any  # the field's resolved annotation, e.g. int | None
    default: Any
    meta: Setting

    @property
    def flag(self) -> str:
        """The CLI flag without its dashes (for a boolean, the positive half of the --x/--no-x pair)."""
        return self.meta.flag or self.kwarg.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return self.type is bool

    @property
    def is_int(self) -> bool:
        args = set(typing.get_args(self.type)) - {type(None)} if isinstance(self.type, types.UnionType) else {self.type}
        return args == {int}

    def check(self, value: Any) -> None:
        """Raise the ValueError the owning dataclass raises for `value` (nothing if it accepts it)."""
        self.owner(**{self.field: value})


@cache
def engine_settings() -> tuple[EngineSetting, ...]:
    out = []
    for owner in _OWNERS:
        hints = typing.get_type_hints(owner)
        for f in fields(owner):
            if SETTING in f.metadata:
                meta: Setting = f.metadata[SETTING]
                out.append(EngineSetting(meta.kwarg or f.name, owner, f.name, hints[f.name], f.default, meta))
    names = [s.kwarg for s in out]
    assert len(names) == len(set(names)), f"two settings share a keyword: {names}"
    return tuple(out)


SETTINGS: dict[str, EngineSetting] = {s.kwarg: s for s in engine_settings()}


def cli_settings() -> tuple[EngineSetting, ...]:
    """The settings every engine command takes as options (all but the API-only ones)."""
    return tuple(s for s in engine_settings() if s.meta.cli)


# ---------------------------------------------------------------------------- LLM keywords -> EngineConfig
def build_engine_config(**kwargs: Any) -> EngineConfig:
    """LLM's keywords (vLLM's names) -> a validated EngineConfig; bad values raise ValueError here, before any
    model loads."""
    unknown = sorted(set(kwargs) - set(SETTINGS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the engine settings are: "
                        f"{', '.join(SETTINGS)}")
    groups: dict[type, dict[str, Any]] = {owner: {} for owner in _OWNERS}
    for kwarg, value in kwargs.items():
        s = SETTINGS[kwarg]
        groups[s.owner][s.field] = value
    return EngineConfig(**groups[EngineConfig], cache=CacheConfig(**groups[CacheConfig]),
                        scheduler=SchedulerConfig(**groups[SchedulerConfig]))


def llm_signature() -> inspect.Signature:
    """`LLM.__init__(self, model=None, *, <every other setting>=<its default>)`."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD)]
    for s in engine_settings():
        kind = P.POSITIONAL_OR_KEYWORD if s.kwarg == "model" else P.KEYWORD_ONLY
        params.append(P(s.kwarg, kind, default=s.default, annotation=s.type))
    return inspect.Signature(params, return_annotation=None)


def settings_doc() -> str:
    """One line per keyword, for LLM's docstring."""
    return "\n".join(f"    {s.kwarg} (default {s.default!r}"
                     + (f"; one of {', '.join(s.meta.choices)}" if s.meta.choices else "") + f"): {s.meta.help}"
                     for s in engine_settings())


def engine_kwargs(params: Mapping[str, Any]) -> dict[str, Any]:
    """The engine settings among a command's parsed parameters, as LLM keywords."""
    return {k: v for k, v in params.items() if k in SETTINGS}


# ---------------------------------------------------------------------------- click options
class SectionOption(click.Option):
    """A click option that knows which section of the help it is listed under."""

    def __init__(self, *args: Any, section: str = "other", **kwargs: Any) -> None:
        assert section in SECTIONS, f"unknown help section {section!r}; the sections are {', '.join(SECTIONS)}"
        super().__init__(*args, **kwargs)
        self.section = section


def section_option(section: str, *decls: str, **attrs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """click.option, listed under `section` in a SectionedCommand's help."""
    return click.option(*decls, cls=SectionOption, section=section, **attrs)


class SectionedCommand(click.Command):
    """A command whose --help lists its options in sections (SECTIONS order), each option under its own
    `section`; options without one go under the command's `default_section`."""

    def __init__(self, *args: Any, default_section: str = "other", **kwargs: Any) -> None:
        assert default_section in SECTIONS, default_section
        super().__init__(*args, **kwargs)
        self.default_section = default_section

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {name: [] for name in SECTIONS}
        help_option = self.get_help_option(ctx)
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None or isinstance(param, click.Argument):  # arguments are in the usage line
                continue
            section = getattr(param, "section", None) or ("other" if param is help_option else self.default_section)
            groups[section].append(record)
        for name, records in groups.items():
            if records:
                with formatter.section(f"{SECTIONS[name]} options"):
                    formatter.write_dl(records)


class JSONObject(click.ParamType):
    """A JSON object on the command line (vLLM's --speculative-config '{"method": "ngram"}') -> a dict."""

    name = "json"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, dict):
            return value
        try:
            obj = json.loads(value)
        except ValueError as e:
            self.fail(f"not valid JSON ({e}): {value!r}", param, ctx)
        if not isinstance(obj, dict):
            self.fail(f"must be a JSON object, got {value!r}", param, ctx)
        return obj


class SettingChoice(click.Choice):
    """click's choice, whose error for a bad value is the owning dataclass's own ValueError, word for word, so
    the command line and LLM(...) say the same thing; a spelling the dataclass accepts (bf16) passes."""

    def __init__(self, setting: EngineSetting) -> None:
        assert setting.meta.choices, setting.kwarg
        super().__init__(setting.meta.choices)
        self.setting = setting

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value in self.choices:
            return value
        try:
            self.setting.check(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


def setting_option(kwarg: str, *, default: Any = _UNSET, help: str | None = None,
                   choices: tuple[str, ...] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The click option of one setting; a command may narrow its default, help or choices (a sweep that only
    supports some values), everything else comes from the field."""
    s = SETTINGS[kwarg]
    default = s.default if default is _UNSET else default
    decls = [f"--{s.flag}/--no-{s.flag}" if s.is_bool else f"--{s.flag}"] + ([s.meta.short] if s.meta.short else [])
    for alias in s.meta.aliases:  # --enable-prefix-caching also gets --no-enable-prefix-caching
        decls.append(f"{alias}/--no-{alias.lstrip('-')}" if s.is_bool else alias)
    if choices is not None:
        kind: Any = click.Choice(choices)
    elif s.meta.choices:
        kind = SettingChoice(s)
    elif s.type == dict | None:
        kind = JSONObject()
    else:
        kind = bool if s.is_bool else int if s.is_int else str
    return click.option(*decls, kwarg, cls=SectionOption, section=s.meta.section, type=kind, default=default,
                        show_default=default is not None, help=help or s.meta.help, metavar=s.meta.metavar)


def engine_options(*, defaults: Mapping[str, Any] | None = None, help: Mapping[str, str] | None = None
                   ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Every engine setting as an option of a command; `defaults` / `help` override them per command (e.g.
    bench latency's prefix cache is off: each run repeats the prompt)."""
    defaults, help = dict(defaults or {}), dict(help or {})
    unknown = (set(defaults) | set(help)) - set(SETTINGS)
    assert not unknown, f"not engine settings: {unknown}"

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        for s in reversed(cli_settings()):
            f = setting_option(s.kwarg, default=defaults.get(s.kwarg, _UNSET), help=help.get(s.kwarg))(f)
        return f

    return decorate


def cli_args(values: Mapping[str, Any]) -> list[str]:
    """The command-line arguments that give an engine command these settings (None = leave the default)."""
    args: list[str] = []
    for kwarg, value in values.items():
        s = SETTINGS[kwarg]
        assert s.meta.cli, f"{kwarg} has no command-line form"
        if value is None:
            continue
        if s.is_bool:
            args.append(f"--{s.flag}" if value else f"--no-{s.flag}")
        else:
            args += [f"--{s.flag}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return args
