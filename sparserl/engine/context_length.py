"""Whether a prompt leaves room for the completion in the model's context: one rule for the engine's check of
each prompt, the trainer's choice of usable rows and eval's check before it samples."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


def prompt_fits(prompt_length: int, max_new_tokens: int, max_positions: int | None) -> bool:
    """A prompt of `prompt_length` tokens plus `max_new_tokens` fits in `max_positions` (None or 0: no limit)."""
    return not max_positions or prompt_length + max_new_tokens <= max_positions


def split_by_fit(
    rows: Iterable[int],
    prompt_length: Callable[[int], int],
    max_new_tokens: int,
    max_positions: int | None,
    want: int | None = None,
) -> tuple[list[int], list[int]]:
    """The rows whose prompt fits (`prompt_fits`) and those whose prompt does not, in order; with `want`, the
    scan stops once that many fit."""
    fit: list[int] = []
    long: list[int] = []
    for i in rows:
        if want is not None and len(fit) >= want:
            break
        (fit if prompt_fits(prompt_length(i), max_new_tokens, max_positions) else long).append(i)
    return fit, long


def too_long_message(
    long: Sequence[int], where: Callable[[int], str], max_new_tokens: int, max_positions: int, key: str
) -> str:
    """'N prompt(s) longer than B tokens (the model's P positions minus KEY=M): a, b, c and K more' for the rows
    `long`, the first three named by `where` (e.g. their file:line); `key` names the setting of max_new_tokens."""
    more = f" and {len(long) - 3} more" if len(long) > 3 else ""
    return (
        f"{len(long)} prompt(s) longer than {max_positions - max_new_tokens} tokens (the model's {max_positions} "
        f"positions minus {key}={max_new_tokens}): {', '.join(where(i) for i in long[:3])}{more}"
    )
