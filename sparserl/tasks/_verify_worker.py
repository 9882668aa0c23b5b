"""Worker process of `rewards.MathVerifier`: reads `[gold, pred]` JSON lines on stdin, answers one JSON line
each on stdout (`{"ok": bool}` or `{"error": str}`). Runs math-verify with its signal timeouts off: the
parent kills this process when a call overruns."""

from __future__ import annotations

import json
import logging
import os
import sys


def _die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to kill this worker when the thread that started it dies (even mid-computation; the
    parent starts it from a thread that lives as long as its process), and exit at once if the parent
    `parent_pid` is already gone (it may die before the request is made)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent_pid is not None and os.getppid() != parent_pid:
        sys.exit(0)


def ignore_interrupts() -> None:
    """Ignore SIGINT and SIGTERM: a Ctrl-C or a scheduler's SIGTERM to the whole process group must not end
    this worker while the trainer finishes its step; the trainer closes it (stdin EOF, or its death)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def main() -> None:
    """Serve requests until stdin closes (the parent pid, when given, is the first argument)."""
    _die_with_parent(int(sys.argv[1]) if len(sys.argv) > 1 else None)
    ignore_interrupts()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the reply stream
    sys.stdout = sys.stderr
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    from math_verify import parse, verify

    gold_cache: dict[str, list] = {}
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            request = json.loads(line)
            gold_text, pred_text = request
            gold = gold_cache.get(gold_text)
            if gold is None:
                gold = parse(gold_text, parsing_timeout=None)
                if len(gold_cache) > 4096:
                    gold_cache.clear()
                gold_cache[gold_text] = gold
            pred = parse(pred_text, parsing_timeout=None)
            ok = bool(verify(gold, pred, timeout_seconds=None)) if gold and pred else False
            out.write(json.dumps({"ok": ok}) + "\n")
        except Exception as e:  # reported to the parent, which counts it
            out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")


if __name__ == "__main__":
    main()
