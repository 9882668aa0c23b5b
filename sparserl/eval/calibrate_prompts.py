"""Calibration prompts of graded length (`sparserl calibrate --lengths`): long_arithmetic problems whose filler
is scaled so that each prompt ends near a target position (1k, 2k, 4k, ... tokens). Each is then followed by a
short sparse generation, so every length bin gets many sequences at the cost of a few hundred generated tokens
each, instead of whole 8k-token generations."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from sparserl.errors import UserError
from sparserl.models import encode_prompt
from sparserl.tasks import make_task

PROBE_DISTRACTORS = 64  # filler lines of the probe prompt that measures the tokens one line costs


def line_cost(task: Any, tokenizer: Any, index: int) -> tuple[int, float]:
    """Problem `index`'s prompt length without filler, and a filler line's mean cost in tokens (measured on a
    probe of `PROBE_DISTRACTORS` lines): what `distractors_for` scales by."""

    def prompt_length(distractors: int) -> int:
        probe = make_task(replace(task.cfg, num_distractors=distractors), task.split)
        return len(encode_prompt(tokenizer, probe[index].messages))

    base = prompt_length(0)
    return base, (prompt_length(PROBE_DISTRACTORS) - base) / PROBE_DISTRACTORS


def distractors_for(length: int, base: int, per_line: float) -> int:
    """How many filler lines put a prompt of `base` tokens without filler at about `length` tokens."""
    if length < base:
        raise UserError(f"--lengths {length}: this task's prompt is {base} tokens before any filler line")
    return round((length - base) / per_line)


def graded_length_prompts(
    task: Any,
    tokenizer: Any,
    lengths: list[int],
    per_length: int,
    offset: int = 0,
    max_tokens: int | None = None,
) -> tuple[list[list[int]], list[dict[str, int]]]:
    """`per_length` prompts (problems offset, offset + 1, ...) at each target length, and what each is
    (target, problem index, filler lines, tokens). Only long_arithmetic has filler to scale. A filler line's
    cost varies by a few percent between problems, so a prompt near the model's context can overshoot it: with
    `max_tokens`, a prompt longer than that has filler lines taken off until it fits (the others unchanged)."""
    if getattr(task, "name", "") != "long_arithmetic":
        raise UserError(
            f"--lengths needs --data long_arithmetic (its filler lines set the prompt length); got "
            f"{getattr(task, 'name', task)!r}"
        )
    if not lengths or min(lengths) < 1:
        raise UserError(f"--lengths {lengths}: give target prompt lengths in tokens, e.g. 1024,2048,4096")
    prompts, described = [], []
    base, per_line = line_cost(task, tokenizer, offset)  # once: the same for every target length
    for length in lengths:
        lines = distractors_for(length, base, per_line)
        scaled = make_task(replace(task.cfg, num_distractors=lines), task.split)
        for index in range(offset, offset + per_length):
            ids, used = encode_prompt(tokenizer, scaled[index].messages), lines
            while max_tokens is not None and len(ids) > max_tokens and used > 0:
                used = max(0, used - math.ceil((len(ids) - max_tokens) / per_line))
                fewer = make_task(replace(task.cfg, num_distractors=used), task.split)
                ids = encode_prompt(tokenizer, fewer[index].messages)
            prompts.append(ids)
            described.append({"target": length, "index": index, "distractors": used, "tokens": len(ids)})
    return prompts, described
