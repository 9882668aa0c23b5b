"""`long_arithmetic`: arithmetic whose operands must be recalled from far back in the context.

Design. The prompt opens with `num_facts` assignments ('Let alpha = 37.'), then `num_distractors` filler
lines that define and update *other* variables ('Let red = 12.', 'Add 5 to red.', 'Subtract 3 from red.'),
and ends with a question over `num_query` of the opening variables ('What is alpha + delta?'). The queried
variables are never touched by the filler, so the answer depends only on facts at the very start of the
prompt; the filler (about 8-10 tokens a line) sets how far back they lie and looks just like them (same
sentence shapes and magnitudes), so it cannot be skipped by surface cues. Under an evicting KV cache whose
budget is below the prompt length, the fact lines are the oldest positions: a method that drops them loses
the answer, and a dense cache does not. The arithmetic itself stays easy (operators and digits as in
`arithmetic`), so what is measured is retention, not calculation. With `layout='question_first'` the opening
lines are replaced by the question itself in `arithmetic`'s plain format ('Question: what is 4 + 3?'), and the
prompt ends by asking for the answer to it: the same recall, without the indirection through names (which
SmolLM2-135M fails even with no filler). Problem i is a pure function of (seed, split, i)."""

from __future__ import annotations

from sparserl.tasks.arithmetic import ArithmeticTask, draw_operand, evaluate, problem_rng, render
from sparserl.tasks.base import Example
from sparserl.tasks.prompts import build_messages

FACT_NAMES = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]
FILLER_NAMES = [
    "red",
    "orange",
    "yellow",
    "green",
    "blue",
    "indigo",
    "violet",
    "amber",
    "coral",
    "ivory",
    "jade",
    "lemon",
    "lilac",
    "maroon",
    "navy",
    "olive",
    "peach",
    "plum",
    "ruby",
    "rust",
    "sand",
    "silver",
    "slate",
    "teal",
    "umber",
    "wheat",
]


class LongArithmeticTask(ArithmeticTask):
    """Long-horizon recall arithmetic; see the module docstring."""

    name = "long_arithmetic"

    def __getitem__(self, i: int) -> Example:
        i = self._index(i)
        c = self.cfg
        rng = problem_rng(self.name, c.seed, self.split, i)
        names = rng.sample(FACT_NAMES, c.num_facts)
        values = {n: draw_operand(rng, c.min_digits, c.max_digits) for n in names}
        lines = ["Read the following assignments in order; you will need some of them at the end."]
        lines += [f"Let {n} = {values[n]}." for n in names]
        filler: dict[str, int] = {}
        for _ in range(c.num_distractors):
            v = draw_operand(rng, c.min_digits, c.max_digits)
            if not filler or rng.random() < 0.4:
                n = rng.choice(FILLER_NAMES)
                filler[n] = v
                lines.append(f"Let {n} = {v}.")
            else:
                n = rng.choice(sorted(filler))
                if rng.random() < 0.5:
                    filler[n] += v
                    lines.append(f"Add {v} to {n}.")
                else:
                    filler[n] -= v
                    lines.append(f"Subtract {v} from {n}.")
        query = rng.sample(names, c.num_query)
        operators = [rng.choice(c.operators) for _ in range(c.num_query - 1)]
        value = evaluate([values[n] for n in query], operators)
        expression = render([], operators, names=query)
        if c.layout == "question_first":  # the same operands, asked in the plain format before the filler
            numbers = render([values[n] for n in query], operators)
            lines[: 1 + c.num_facts] = [f"Question: what is {numbers}? Answer it after reading these notes."]
            lines.append("Now answer the question asked at the start.")
        else:
            lines.append(f"Question: using the values given at the start, what is {expression}?")
        messages = build_messages("\n".join(lines), c.instruction, c.system_prompt)
        meta = {
            "index": i,
            "split": self.split,
            "expression": expression,
            "facts": {n: values[n] for n in query},
            "num_distractors": c.num_distractors,
        }
        return Example(messages, str(value), meta)
