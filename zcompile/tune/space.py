"""The tuner's search space: checked before anything compiles, then enumerated into points.

``SearchSpace.build(space, base_options)`` refuses, with the option and the fix named, an option
that is not a zero backend option (or one the tuner owns), an empty or non-list candidate list, a
candidate of the wrong type or range (``ZeroConfig``'s own check, run on each candidate alone), an option given both in ``space`` and ``base_options``. A combination of valid
candidates that ``ZeroConfig`` refuses together (``stage=2`` with ``keep_gathered_mb=8``) is not an
error: the point is kept as ``invalid`` with the reason, and the search skips it.

Points are the Cartesian product in the order the space lists options and candidates; the point's
index in that order breaks every tie. The default point (the base options alone) is always
among them: appended, flagged, when the space does not contain it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from zcompile.config import ZeroConfig
from zcompile.tune.policies import GREEDY, POLICY_FIX, POLICY_NAMES

TUNER_OWNED = ("on_compile", "group")  # on_compile: the tuner records graphs; group: not a schedule choice
POLICY_OPTION = "schedule_policy"


@dataclass(frozen=True)
class Point:
    """One configuration: its options as given (policy names unresolved) and where it came from."""

    index: int
    options: dict[str, Any]  # the space's options of this point (the base options are not repeated)
    is_default: bool
    invalid: str = ""  # why ZeroConfig refuses this combination ("" when valid)


@dataclass(frozen=True)
class SearchSpace:
    base_options: dict[str, Any]
    space: dict[str, list]
    points: tuple[Point, ...]

    @classmethod
    def build(cls, space: Any, base_options: dict[str, Any] | None) -> SearchSpace:
        base = dict(base_options or {})
        _check_base(base)
        _check_space(space, base)
        space = {name: list(candidates) for name, candidates in space.items()}
        default_config = _config(base, {})
        points, default_found = [], False
        for combo in itertools.product(*space.values()):
            options = dict(zip(space, combo))
            invalid = ""
            try:
                is_default = _config(base, options) == default_config
            except (TypeError, ValueError) as error:
                invalid, is_default = str(error), False
            default_found |= is_default
            points.append(Point(len(points), options, is_default, invalid))
        if not default_found:
            points.append(Point(len(points), {name: _default_value(base, name) for name in space}, True))
        return cls(base, space, tuple(points))

    def __len__(self) -> int:
        return len(self.points)

    @property
    def default(self) -> Point:
        return next(p for p in self.points if p.is_default)


def _config(base: dict[str, Any], options: dict[str, Any]) -> ZeroConfig:
    """The ZeroConfig of ``base`` + ``options``, a policy name standing for a placeholder callable of
    its own (so two points with the same policy name compare equal)."""
    merged = {**base, **options}
    if isinstance(merged.get(POLICY_OPTION), str):
        merged[POLICY_OPTION] = None if merged[POLICY_OPTION] == GREEDY else _NAMED_POLICIES[merged[POLICY_OPTION]]
    return ZeroConfig.from_options(merged)


def _named_placeholder(name: str) -> Callable:
    def placeholder(problem):  # never called: stands for the named policy while options are checked
        raise AssertionError(name)

    placeholder.__name__ = name
    return placeholder


_NAMED_POLICIES = {name: _named_placeholder(name) for name in POLICY_NAMES}  # constant, never mutated


def _default_value(base: dict[str, Any], name: str) -> Any:
    if name in base:
        return base[name]
    value = next(f.default for f in fields(ZeroConfig) if f.name == name)
    return GREEDY if name == POLICY_OPTION and value is None else value


def _check_base(base: dict[str, Any]) -> None:
    if not isinstance(base, dict):
        raise TypeError(
            f"zcompile.tune: base_options must be a dict of zero backend options, got {type(base).__name__}"
        )
    if "on_compile" in base:
        raise ValueError(
            "zcompile.tune: base_options may not set 'on_compile': the tuner records the compiled graphs itself"
        )
    try:
        _config(base, {})
    except (TypeError, ValueError) as error:
        raise type(error)(f"zcompile.tune: base_options: {error}") from None


def _check_space(space: Any, base: dict[str, Any]) -> None:
    valid = [f.name for f in fields(ZeroConfig) if f.name not in TUNER_OWNED]
    if not isinstance(space, dict) or not space:
        raise ValueError(
            f"zcompile.tune: space must be a non-empty dict of option -> list of candidates, e.g. "
            f"{{'bucket_mb': [1, 4], 'prefetch': [1, 2]}}; got {space!r}"
        )
    for name, candidates in space.items():
        if name not in valid:
            raise ValueError(
                f"zcompile.tune: space option {name!r} is not a zero backend option the tuner can vary; "
                f"valid options are {valid}"
            )
        if name in base:
            raise ValueError(
                f"zcompile.tune: option {name!r} is both in space and in base_options; keep it in one of them"
            )
        if isinstance(candidates, (str, bytes)) or not isinstance(candidates, (list, tuple)):
            raise TypeError(
                f"zcompile.tune: space[{name!r}] must be a list of candidates, got {candidates!r}; "
                f"write space[{name!r}] = [{candidates!r}]"
            )
        if not candidates:
            raise ValueError(
                f"zcompile.tune: space[{name!r}] is empty; give at least one candidate, or drop the option"
            )
        for candidate in candidates:
            _check_candidate(name, candidate, base)


def _check_candidate(name: str, candidate: Any, base: dict[str, Any]) -> None:
    if name == POLICY_OPTION and isinstance(candidate, str) and candidate not in POLICY_NAMES:
        raise ValueError(
            f"zcompile.tune: space['schedule_policy'] candidate {candidate!r} is not a built-in policy; {POLICY_FIX}"
        )
    if isinstance(candidate, torch.distributed.ProcessGroup):
        raise TypeError(f"zcompile.tune: space[{name!r}]: a process group is not a candidate")
    try:
        ZeroConfig.from_options(_config_candidate(name, candidate))
    except (TypeError, ValueError) as error:
        raise type(error)(f"zcompile.tune: space[{name!r}] candidate {candidate!r}: {error}") from None


def _config_candidate(name: str, candidate: Any) -> dict[str, Any]:
    """The candidate alone on the defaults (stage 3, where every option applies): its type and range
    are checked; a conflict with other options is the combination's problem (an ``invalid`` point)."""
    if name == POLICY_OPTION and isinstance(candidate, str):
        candidate = None if candidate == GREEDY else _NAMED_POLICIES[candidate]
    return {name: candidate}
