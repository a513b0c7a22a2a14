"""A strategy's own run-config keys as a typed dataclass (`StrategySettings`) and their parsing.

Each strategy module declares its keys once, as `setting` fields of a `StrategySettings`
subclass: the field name is the constructor argument, the metadata carries the dash-case key,
its one-line help and its rule. The App's registry (strategies/) maps a name to the strategy
class and its settings class; the schema reads every registered strategy's keys from there.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, Self

Rule = tuple[Callable[[Any], bool], str]
"""A check on a value and the words the error uses for it ("finite and >= 0")."""

NON_NEGATIVE: Rule = (lambda value: math.isfinite(value) and value >= 0, "finite and >= 0")
POSITIVE: Rule = (lambda value: math.isfinite(value) and value > 0, "finite and > 0")


def within(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Rule:
    """A value in the interval from `low` to `high` (each end closed unless said open)."""

    def check(value: float) -> bool:
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        return math.isfinite(value) and above and below

    words = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    return (check, words)


MAX_STEP_SCALE = 1e3
"""Largest server learning rate a run-config may set: a step a thousand times the mean update."""
MAX_LOSS_WEIGHT = 1e6
"""Largest weight a run-config may give a penalty term of the local loss: beyond it the term
overflows a float32 loss once the weights move."""
MISSPELT_CUTOFF = 0.85
"""difflib similarity above which an unknown key is taken for a misspelling of a known one
("beta-l" of "beta-1"; "beta-1" and "beta-2" stay apart)."""


def optional_cap(value: float | None, name: str) -> float | None:
    """A positive finite cap, or None for 0/None (no cap); ValueError otherwise."""
    if value is None or (not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0 and finite (0 or None: no cap), got {value!r}")
    return float(value)


def setting(default: Any, key: str, doc: str, rule: Rule | None = None) -> Any:
    """A strategy's run-config key: its default, dash-case name, help line and rule."""
    return field(default=default, metadata={"key": key, "doc": doc, "rule": rule})


def typed_value(run_key: str, value: Any, spec: Field[Any]) -> Any:
    """`value` as the field's type (an int is a valid float); ValueError naming the key."""
    expected = type(spec.default) if spec.default is not MISSING else object
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool):
        raise ValueError(f"run-config '{run_key}' must be {expected.__name__}, got {value!r}")
    return value


@dataclass(frozen=True)
class StrategySettings:
    """A strategy's own run-config keys (none here); subclasses add `setting` fields."""

    robust_rules: ClassVar[bool] = False
    """Whether the strategy's server step starts from FedAvg's mean, which run-config
    `aggregation-rule` may replace by a robust rule."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            rule = spec.metadata["rule"]
            value = getattr(self, spec.name)
            if rule is not None and not rule[0](value):
                raise ValueError(
                    f"run-config '{spec.metadata['key']}' must be {rule[1]}, got {value!r}"
                )

    @classmethod
    def keys(cls) -> dict[str, Field[Any]]:
        """Run-config key -> its field, in declaration order."""
        return {spec.metadata["key"]: spec for spec in fields(cls)}

    @classmethod
    def refuse_misspelt(cls, run_config: Mapping[str, Any]) -> None:
        """ValueError naming a key of `run_config` that is a near miss of one of these keys
        (a misspelling, which would otherwise leave the setting at its default)."""
        own = cls.keys()
        for run_key in run_config:
            close = difflib.get_close_matches(run_key, own, n=1, cutoff=MISSPELT_CUTOFF)
            if run_key not in own and close:
                raise ValueError(f"unknown run-config key {run_key!r}; did you mean {close[0]!r}?")

    @classmethod
    def given(cls, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """Constructor arguments of the keys present in `run_config`, typed and checked
        (absent keys are left out, so they keep the constructor's defaults)."""
        own = cls.keys()
        present = {
            spec.name: typed_value(run_key, run_config[run_key], spec)
            for run_key, spec in own.items()
            if run_key in run_config
        }
        cls(**present)  # the rules, with the defaults for the absent keys
        return present

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> Self:
        """The settings of the keys in `run_config`, defaults for the absent ones."""
        return cls(**cls.given(run_config))

    def arguments(self) -> dict[str, Any]:
        """The strategy's constructor arguments (field name -> value)."""
        return {spec.name: getattr(self, spec.name) for spec in fields(self)}

    def to_run_config(self) -> dict[str, Any]:
        """Dash-case key -> value, as `from_run_config` reads them back."""
        return {spec.metadata["key"]: getattr(self, spec.name) for spec in fields(self)}
