"""Prompt construction: plain chat messages ending with the \\boxed{} instruction (the models module
applies the chat template)."""

from __future__ import annotations

from typing import Any


def build_messages(question: str, instruction: str, system_prompt: str = "") -> list[dict]:
    """`[system?] + user(question + newline + instruction)`; the instruction is left out when the question
    already asks for \\boxed{}."""
    content = question.strip()
    if instruction and "\\boxed" not in content:
        content = f"{content}\n{instruction}"
    messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": content})
    return messages


def normalize_messages(messages: Any, instruction: str, system_prompt: str = "") -> list[dict]:
    """Check chat messages from a dataset and bring them to the same shape as `build_messages`: the last one
    is the user's, `\\boxed{{}}` (a str.format artefact of some datasets) reads `\\boxed{}`, the instruction
    is appended when no message asks for \\boxed{}, and `system_prompt` (when set) replaces the system
    message. Raises ValueError naming what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("chat messages must be a non-empty list of {'role', 'content'} dicts")
    out: list[dict] = []
    for m in messages:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(f"chat message {m!r} needs a string 'role' and a string 'content'")
        out.append({"role": m["role"], "content": m["content"].replace("\\boxed{{}}", "\\boxed{}")})
    if out[-1]["role"] != "user":
        raise ValueError(f"the last chat message must be the user's, not {out[-1]['role']!r}")
    if instruction and not any("\\boxed" in m["content"] for m in out):
        out[-1]["content"] = f"{out[-1]['content'].rstrip()}\n{instruction}"
    if system_prompt:
        out = [{"role": "system", "content": system_prompt}] + [m for m in out if m["role"] != "system"]
    return out
