"""Argument checks shared by every public entry point.

One message shape everywhere: ``ValueError("<name> must be <accepted>, got <value>")``, raised before
anything collective starts, so a bad argument fails the same way on every rank. No Horovod import.
"""
import math
import numbers

__all__ = ["check_int", "check_number", "check_choice"]


def check_int(name, value, low=0, high=None):
    """``int(value)``, or ValueError unless value is an integer (not a bool) in [low, high].

    Example:
        >>> check_int("repeats", 3, low=1)
        3
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low \
            or (high is not None and value > high):
        accepted = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {accepted}, got {value!r}")
    return int(value)


def check_number(name, value, low=None, high=None, low_open=False, what=""):
    """``float(value)``, or ValueError unless value is a finite real number (not a bool) with
    ``low <= value <= high`` (``low < value`` with ``low_open``); a bound that is None is not checked.

    ``what`` is appended to the accepted range in the message, e.g. "(seconds)".

    Example:
        >>> check_number("ratio", 0.01, low=0, high=1, low_open=True)
        0.01
    """
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        if low is not None and high is not None:
            accepted = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
        elif low is not None:
            accepted = f"a finite number {'>' if low_open else '>='} {low:g}"
        elif high is not None:
            accepted = f"a finite number <= {high:g}"
        else:
            accepted = "a finite number"
        raise ValueError(f"{name} must be {accepted}{' ' + what if what else ''}, got {value!r}")
    return float(value)


def check_choice(name, value, choices):
    """``value``, or ValueError unless it is one of ``choices``.

    Example:
        >>> check_choice("leader", "star", ("star", "var"))
        'star'
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value
