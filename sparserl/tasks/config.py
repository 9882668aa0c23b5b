"""TaskConfig: which prompts the trainer samples and how their completions are rewarded."""

from __future__ import annotations

import math
import string
from dataclasses import dataclass, field

from sparserl.errors import UserError

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
BUILTIN_TASKS = ("arithmetic", "long_arithmetic", "gsm8k", "math")
REWARD_STYLES = ("auto", "trl", "verl")  # task.reward_style
BUILTIN_REWARD = "builtin"  # in task.reward: the task's own verifiable reward
GENERATED_TASKS = ("arithmetic", "long_arithmetic")  # procedural: they read no data
LONG_LAYOUTS = ("facts", "question_first")  # long_arithmetic: where the recalled values are stated


@dataclass
class TaskConfig:
    """Task selection, data source and field mapping, procedural difficulty and reward options."""

    name: str = field(
        default="arithmetic",
        metadata={
            "help": "Task: 'arithmetic', 'long_arithmetic' (procedural, no files), 'gsm8k', 'math', or a "
            "local .jsonl/.json/.parquet path or a Hugging Face dataset name (then read like `data`); with `data` set, "
            "any other name just labels that dataset."
        },
    )
    data: str = field(
        default="",
        metadata={
            "help": "Data source of gsm8k/math/dataset tasks: a local .jsonl/.json/.parquet file or a Hugging "
            "Face dataset name. '{split}' in a path is replaced by the split. Empty: the task's default "
            "(gsm8k: openai/gsm8k; math: DigitalLearningGmbH/MATH-lighteval)."
        },
    )
    data_config: str = field(
        default="",
        metadata={
            "help": "Hugging Face dataset configuration name (e.g. 'main' for openai/gsm8k); empty: default."
        },
    )
    split: str = field(
        default="",
        metadata={
            "help": "Split to read; empty: the split the caller asks for ('train' for training, 'test' for "
            "eval). Procedural tasks draw a different stream of problems per split."
        },
    )
    question_key: str = field(
        default="",
        metadata={
            "help": "Row field holding the question (a string or a list of chat messages); dotted for nested "
            "fields ('extra.q'). Empty: auto-detect problem/question/prompt/query/input/instruction."
        },
    )
    answer_key: str = field(
        default="",
        metadata={
            "help": "Row field holding the reference answer; dotted for nested fields "
            "('reward_model.ground_truth'). Empty: auto-detect final_answer/answer/label/ground_truth/gt/"
            "target/solution. '#### N' and \\boxed{} in it are reduced to the final answer."
        },
    )
    prompt_template: str = field(
        default="",
        metadata={
            "help": "Datasets: the question built from row fields, str.format style, e.g. '{context} "
            "{question}' (dotted for nested fields; '{{' and '}}' for literal braces; a null field reads as "
            "empty). Replaces task.question_key. Empty: the question field alone."
        },
    )
    max_examples: int = field(default=0, metadata={"help": "Datasets: keep only the first N rows (0 = all)."})
    num_examples: int = field(
        default=10000, metadata={"help": "Procedural tasks: number of distinct problems per split."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the procedural problem generators."})
    num_operands: int = field(default=2, metadata={"help": "arithmetic: operands per expression (>= 2)."})
    min_digits: int = field(
        default=1, metadata={"help": "arithmetic/long_arithmetic: fewest digits of an operand."}
    )
    max_digits: int = field(
        default=2, metadata={"help": "arithmetic/long_arithmetic: most digits of an operand."}
    )
    operators: str = field(
        default="+",
        metadata={"help": "arithmetic/long_arithmetic: operators to draw from, any of '+-*' (e.g. '+-')."},
    )
    num_facts: int = field(
        default=3,
        metadata={
            "help": "long_arithmetic: named values defined at the very start of the prompt (the question "
            "combines num_query of them)."
        },
    )
    num_query: int = field(
        default=2,
        metadata={"help": "long_arithmetic: early values the final question combines (<= num_facts)."},
    )
    layout: str = field(
        default="facts",
        metadata={
            "help": "long_arithmetic: 'facts' states named values first and asks about them at the end; "
            "'question_first' states the whole question ('What is 4 + 3?') first, then the filler, then asks "
            "for the answer to the opening question (the same recall, in the plain format of 'arithmetic')."
        },
    )
    num_distractors: int = field(
        default=40,
        metadata={
            "help": "long_arithmetic: filler lines (other named values and their updates) between the early "
            "facts and the question; sets the distance the answer must be recalled across (~12 tokens each)."
        },
    )
    format_weight: float = field(
        default=0.0,
        metadata={
            "help": "Weight w of the format reward: reward = (1 - w) * correct + w * [well-formed \\boxed{} "
            "present]; 0 = correctness only."
        },
    )
    reward: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Your own reward functions, TRL style: 'module:function' or 'path/to/file.py:function', "
            "each called as fn(completions=[str], prompts=[chat messages], completion_ids, trainer_state, "
            "log_metric, log_extra, **row_fields) -> [float] (a row's fields as keyword lists aligned with the "
            "completions; a function gets the keywords it names; None for 'does not apply' scores 0; async "
            f"def is awaited), or verl's compute_score (task.reward_style). '{BUILTIN_REWARD}' is the task's "
            "own verifiable reward. Empty: the built-in reward only."
        },
    )
    reward_style: str = field(
        default="auto",
        metadata={
            "help": "How task.reward functions are called: 'trl' (a batch of completions, TRL's reward_funcs), "
            "'verl' (one completion at a time: data_source, solution_str, ground_truth, extra_info -> a "
            "number or a dict with 'score', its other keys logged), or 'auto': verl's for a function naming "
            "solution_str and ground_truth (but not completions), else TRL's."
        },
    )
    reward_weights: list[float] = field(
        default_factory=list,
        metadata={
            "help": "Weight of each function in task.reward (the reward is their weighted sum); empty: 1.0 "
            "each."
        },
    )
    reward_timeout: float = field(
        default=5.0,
        metadata={
            "help": "Seconds one reward call may take (math-verify runs in a killable worker process); a "
            "timeout or error scores 0 and is counted in the reward stats. inf: no limit."
        },
    )
    system_prompt: str = field(
        default="",
        metadata={
            "help": "System message put first in every prompt (replacing one from the data); empty: none "
            "added (the chat template may add its own)."
        },
    )
    instruction: str = field(
        default=BOXED_INSTRUCTION,
        metadata={
            "help": "Instruction appended to the question (on its own line) unless it already asks for \\boxed{}."
        },
    )

    on_long_prompt: str = field(
        default="skip",
        metadata={
            "help": "A data row whose prompt leaves no room for rollout.max_new_tokens in the model's context: "
            "'skip' it with a warning naming its file:line (checked once, when the data is loaded), or "
            "'error' to stop before training."
        },
    )

    def __post_init__(self) -> None:
        if self.on_long_prompt not in ("skip", "error"):
            raise UserError(f"task.on_long_prompt={self.on_long_prompt!r} must be 'skip' or 'error'")
        if self.data and self.name in GENERATED_TASKS:
            raise UserError(
                f"task.data={self.data!r} is set but task.name={self.name!r} generates its problems and reads "
                "no data: leave task.name unset (the data then selects the dataset task) or set it to a "
                "label of yours, or unset task.data"
            )
        if not self.name:
            raise UserError(f"task.name is empty; choose one of {', '.join(BUILTIN_TASKS)} or a data path")
        bad_ops = set(self.operators) - set("+-*")
        if not self.operators or bad_ops:
            raise UserError(f"task.operators={self.operators!r} must be a non-empty string of '+', '-', '*'")
        if self.num_operands < 2:
            raise UserError(f"task.num_operands={self.num_operands} must be >= 2")
        if not 1 <= self.min_digits <= self.max_digits:
            raise UserError(
                f"task.min_digits={self.min_digits} and task.max_digits={self.max_digits} need "
                "1 <= min_digits <= max_digits"
            )
        if self.max_digits > 18:
            raise UserError(f"task.max_digits={self.max_digits} must be <= 18")
        if not 1 <= self.num_query <= self.num_facts:
            raise UserError(
                f"task.num_query={self.num_query} must be between 1 and task.num_facts={self.num_facts}"
            )
        if self.layout not in LONG_LAYOUTS:
            raise UserError(f"task.layout={self.layout!r}: choose one of {', '.join(LONG_LAYOUTS)}")
        if self.num_facts > 26 or self.num_distractors < 0 or self.num_distractors > 10000:
            raise UserError(
                f"task.num_facts={self.num_facts} must be <= 26 and task.num_distractors="
                f"{self.num_distractors} between 0 and 10000"
            )
        if self.num_examples < 1 or self.max_examples < 0:
            raise UserError(
                f"task.num_examples={self.num_examples} must be >= 1 and task.max_examples="
                f"{self.max_examples} >= 0"
            )
        if not 0.0 <= self.format_weight <= 1.0:
            raise UserError(f"task.format_weight={self.format_weight} must be in [0, 1]")
        if not self.reward_timeout > 0:
            raise UserError(f"task.reward_timeout={self.reward_timeout} must be > 0 seconds")
        self._check_rewards()
        self._check_prompt_template()

    def _check_rewards(self) -> None:
        """Reward specs look like 'module:function' or 'builtin'; weights are finite, one per function; the
        style is known."""
        if self.reward_style not in REWARD_STYLES:
            raise UserError(
                f"task.reward_style={self.reward_style!r}: choose one of {', '.join(REWARD_STYLES)}"
            )
        for spec in self.reward:
            if spec != BUILTIN_REWARD and (":" not in spec or not all(spec.rsplit(":", 1))):
                raise UserError(
                    f"task.reward entry {spec!r} must be 'module:function', 'path/to/file.py:function' or "
                    f"'{BUILTIN_REWARD}'"
                )
        if self.reward_weights and len(self.reward_weights) != len(self.reward):
            raise UserError(
                f"task.reward_weights has {len(self.reward_weights)} weights for {len(self.reward)} "
                "functions in task.reward; give one per function (or none: 1.0 each)"
            )
        if not all(math.isfinite(w) for w in self.reward_weights):
            raise UserError(f"task.reward_weights={self.reward_weights} must be finite numbers")

    def _check_prompt_template(self) -> None:
        """The template parses, names at least one field, and is not combined with task.question_key."""
        if not self.prompt_template:
            return
        if self.question_key:
            raise UserError(
                "task.prompt_template and task.question_key are exclusive: the template names the fields"
            )
        try:
            names = [
                name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name is not None
            ]
        except ValueError as e:
            raise UserError(
                f"task.prompt_template={self.prompt_template!r} is malformed ({e}); write '{{{{' and '}}}}' "
                "for literal braces"
            ) from None
        if not names or "" in names or any(name.isdigit() for name in names):
            raise UserError(
                f"task.prompt_template={self.prompt_template!r} must name row fields, like '{{context}} "
                "{question}' ('{}' and '{0}' are not fields; write '{{}}' for literal braces)"
            )
