"""`gsm8k`, `math` and any other question/answer dataset, from a local JSONL/JSON/Parquet file or a Hugging
Face dataset name, with per-file field mapping.

The question and answer fields are detected on the first row (`QUESTION_KEYS`, `ANSWER_KEYS`, in order) or
set with `task.question_key` / `task.answer_key` (dotted for nested fields). The question may be a string or
a list of chat messages. The reference is reduced to the final answer (`#### N`, last `\\boxed{}`, lists
joined, units after a number dropped). `task.prompt_template` builds the question from several fields
('{context} {question}'); when the auto-detected question field leaves other text fields out, a warning says
so once per file. A malformed row (bad JSON or UTF-8, missing field, no final answer in a solution) raises
DataError naming the file and line (or row); a row whose answer is empty is skipped with a warning (it cannot
be scored)."""

from __future__ import annotations

import json
import logging
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sparserl.errors import DataError
from sparserl.hub import hub_offline, unreachable
from sparserl.tasks.answers import extract_boxed, extract_hash_answer, reference_answer
from sparserl.tasks.base import Example, Task
from sparserl.tasks.config import TaskConfig
from sparserl.tasks.prompts import build_messages, normalize_messages
from sparserl.tasks.rewards import get_verifier, math_reward

logger = logging.getLogger(__name__)

QUESTION_KEYS = ("problem", "question", "prompt", "query", "input", "instruction")
ANSWER_KEYS = ("final_answer", "answer", "label", "ground_truth", "gt", "target", "solution")
ANSWER_KEYS += ("reward_model.ground_truth",)  # verl's data layout
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
DEFAULT_SOURCES = {
    "gsm8k": ("openai/gsm8k", "main"),
    "math": ("DigitalLearningGmbH/MATH-lighteval", "default"),
}


def is_local_source(source: str) -> bool:
    """A path to a file (existing, or named like one) rather than a Hugging Face dataset name."""
    return Path(source).suffix.lower() in LOCAL_SUFFIXES or Path(source).is_file()


def read_utf8(path: Path) -> str:
    """The text of `path`; DataError naming the file and line of the first byte that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark (Windows editors write one) is dropped
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}:{line}: not UTF-8 text (byte {e.object[e.start : e.start + 1]!r}); save the file as UTF-8"
        ) from None


def iter_rows(source: str, split: str = "train", data_config: str = "") -> Iterator[tuple[dict, str]]:
    """Rows of `source` with their location ('file:LINE', 'file row N', 'name[split] row N')."""
    if is_local_source(source):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {source} does not exist")
        if path.suffix.lower() == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                table = pq.read_table(path)
            except (pa.ArrowException, OSError) as e:
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise DataError(f"{path}: not a readable Parquet file ({reason})") from None
            for n, row in enumerate(table.to_pylist(), start=1):
                yield row, f"{path} row {n}"
            return
        text = read_utf8(path)
        if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
            for n, row in enumerate(rows, start=1):
                yield row, f"{path} item {n}"
            return
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                at = "" if e.msg.endswith(" at") else " at"  # 'Unterminated string starting at' names a place
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}{at} column {e.colno})") from None
            yield row, f"{path}:{lineno}"
        return
    offline = hub_offline()  # before importing datasets, which reads it then
    import datasets

    try:
        ds = datasets.load_dataset(source, data_config or None, split=split)
    except Exception as e:
        if offline:
            raise DataError(
                f"task data {source!r} is not a local .jsonl/.json/.parquet file, and "
                f"{unreachable('as a Hugging Face dataset it')}"
            ) from e
        raise DataError(
            f"task data {source!r} is not a local .jsonl/.json/.parquet file and could not be loaded as a "
            f"Hugging Face dataset (config {data_config or None!r}, split {split!r}): {e}"
        ) from e
    for n, row in enumerate(ds, start=1):
        yield dict(row), f"{source}[{split}] row {n}"


def get_field(row: dict, key: str) -> Any:
    """`row[key]`, following dots into nested dicts; KeyError if absent."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def detect_key(row: dict, candidates: tuple[str, ...], what: str, where: str, override_name: str) -> str:
    """The first candidate present (and not None) in `row` (a dotted one in nested fields)."""
    for key in candidates:
        try:
            if get_field(row, key) is not None:
                return key
        except KeyError:
            continue
    raise DataError(
        f"{where}: no {what} field found among {', '.join(candidates)} (row has {', '.join(row) or 'no fields'}); "
        f"set task.{override_name}"
    )


def row_answer(value: Any, key: str, where: str) -> str:
    """The final answer in a row's answer field (raising, with the location, when there is none)."""
    try:
        answer = reference_answer(value)
    except ValueError as e:
        raise DataError(f"{where}: field {key!r}: {e}") from None
    if (
        "solution" in key.lower()
        and isinstance(value, str)
        and extract_boxed(value) is None
        and extract_hash_answer(value) is None
    ):
        raise DataError(f"{where}: field {key!r} holds no \\boxed{{}} or '#### N' final answer")
    return answer


def _meta_value(v: Any) -> bool:
    return isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 200)


class _RowFormatter(string.Formatter):
    """str.format over a data row: fields by name, dotted for nested ones; a null field reads as ''."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        """The row's value for `{field_name}` (KeyError naming it when absent)."""
        value = get_field(kwargs, field_name)
        return ("" if value is None else value), field_name


def render_template(template: str, row: dict, where: str) -> str:
    """`task.prompt_template` filled from `row`; DataError naming the location and the row's fields when the
    template names a field the row lacks."""
    try:
        return _RowFormatter().vformat(template, (), row)
    except KeyError as e:
        raise DataError(
            f"{where}: task.prompt_template names field {e.args[0]!r}, which the row lacks (row has: "
            f"{', '.join(row) or 'no fields'})"
        ) from None
    except (ValueError, TypeError, IndexError) as e:
        raise DataError(f"{where}: task.prompt_template={template!r} does not fit the row: {e}") from None


def _is_prose(value: Any) -> bool:
    """A string that reads like sentences (ends like one, or is long), not a label, id or URL."""
    text = value.strip() if isinstance(value, str) else ""
    return " " in text and (len(text) > 80 or text.endswith((".", "?", "!", ":")))


def unused_text_fields(row: dict, used: tuple[str, ...], question: Any) -> list[str]:
    """Fields of `row` holding prose that neither the prompt nor the answer uses, other than reference
    fields (answer/solution/...) and copies of the question: possibly facts the auto-detected question
    field leaves out (a 'context' or 'body' beside the 'question')."""
    return [
        k for k, v in row.items() if k not in used and k not in ANSWER_KEYS and v != question and _is_prose(v)
    ]


_REPORTED_SOURCES: set[str] = set()  # files whose ignored fields were reported (once per file)


class DatasetTask(Task):
    """Questions and references read once from a file or a Hugging Face dataset; math-verify reward."""

    self_guarded = True

    def __init__(
        self, cfg: TaskConfig, split: str = "train", source: str = "", data_config: str = ""
    ) -> None:
        self.cfg = cfg
        self.split = split
        self.reward_timeout = cfg.reward_timeout
        self.source = source.replace("{split}", split)
        self.name = cfg.name
        self.examples: list[Example] = []
        self.skipped: list[str] = []  # locations of rows with an empty reference answer
        self.question_key, self.answer_key = cfg.question_key, cfg.answer_key
        ignored: dict[str, str] = {}  # text field left out of an auto-detected prompt -> first location
        for row, where in iter_rows(self.source, split, data_config):
            if cfg.max_examples and len(self.examples) >= cfg.max_examples:
                break
            if not isinstance(row, dict):
                raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            example = self._example(row, where)
            if example is None:
                continue
            self.examples.append(example)
            if not (cfg.question_key or cfg.prompt_template):
                used = (self.question_key, self.answer_key)
                for key in unused_text_fields(row, used, row.get(self.question_key)):
                    ignored.setdefault(key, where)
        if self.skipped:
            logger.warning(
                "%s: skipped %d rows with an empty answer (%s%s)",
                self.source,
                len(self.skipped),
                ", ".join(self.skipped[:3]),
                ", ..." if len(self.skipped) > 3 else "",
            )
        if not self.examples:
            raise DataError(f"task data {self.source!r} (split {split!r}) holds no rows")
        if ignored:
            self._report_ignored(ignored)

    def _example(self, row: dict, where: str) -> Example | None:
        """The example of one data row (None for a row with an empty answer, recorded in `skipped`); the
        question and answer fields are detected on the first row unless set."""
        cfg = self.cfg
        if not cfg.prompt_template:
            self.question_key = self.question_key or detect_key(
                row, QUESTION_KEYS, "question", where, "question_key"
            )
        self.answer_key = self.answer_key or detect_key(row, ANSWER_KEYS, "answer", where, "answer_key")
        label = "task.prompt_template" if cfg.prompt_template else repr(self.question_key)
        try:
            answer_value = get_field(row, self.answer_key)
            question = (
                render_template(cfg.prompt_template, row, where)
                if cfg.prompt_template
                else get_field(row, self.question_key)
            )
        except KeyError as e:
            raise DataError(f"{where}: missing field {e.args[0]!r} (row has {', '.join(row)})") from None
        answer = row_answer(answer_value, self.answer_key, where)
        if not answer.strip():  # unscorable (2 such rows in the SimpleRL MATH file): skipped, not fatal
            self.skipped.append(where)
            return None
        try:
            if isinstance(question, str) and question.strip():
                messages = build_messages(question, cfg.instruction, cfg.system_prompt)
            elif isinstance(question, (list, tuple)):
                messages = normalize_messages(question, cfg.instruction, cfg.system_prompt)
            else:
                raise ValueError("must be a non-empty string or a list of chat messages")
        except ValueError as e:
            raise DataError(f"{where}: field {label}: {e}") from None
        used = (self.question_key, self.answer_key)
        meta = {k: v for k, v in row.items() if k not in used and _meta_value(v)}
        meta.update(source=where, index=len(self.examples))
        return Example(messages, answer, meta, row=row)

    def _report_ignored(self, ignored: dict[str, str]) -> None:
        """Say once per file which fields the auto-detected prompt uses and which text fields it leaves out."""
        if self.source in _REPORTED_SOURCES:
            return
        _REPORTED_SOURCES.add(self.source)
        fields = ", ".join(f"{k!r} (first at {where})" for k, where in ignored.items())
        example = " ".join(f"{{{k}}}" for k in [*ignored, self.question_key])
        logger.warning(
            "%s: the prompt is field %r and the answer field %r (auto-detected); text fields left out of the "
            "prompt: %s. If they belong to the problem, set task.prompt_template (e.g. '%s').",
            self.source,
            self.question_key,
            self.answer_key,
            fields,
            example,
        )

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    def warmup(self) -> None:
        """Start the math-verify worker outside any timed reward call."""
        get_verifier().start()

    def reward(self, completion_text: str, example: Example) -> float:
        """math-verify equivalence of the extracted answer with the reference, mixed with the format reward."""
        return math_reward(completion_text, example.answer, self.cfg.format_weight, self.cfg.reward_timeout)


def make_dataset_task(cfg: TaskConfig, split: str) -> DatasetTask:
    """The gsm8k/math task (default Hugging Face source unless `task.data` is set) or a task read from the
    file or dataset named by `task.name`."""
    if cfg.data:
        return DatasetTask(cfg, split, cfg.data, cfg.data_config)
    if cfg.name in DEFAULT_SOURCES:
        source, config = DEFAULT_SOURCES[cfg.name]
        return DatasetTask(cfg, split, source, cfg.data_config or config)
    return DatasetTask(cfg, split, cfg.name, cfg.data_config)
